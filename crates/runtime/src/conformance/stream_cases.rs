//! Conformance cases for stream priorities and device timestamps.

use super::cases::{download, scale_args, upload};
use super::{first_client, kernels};
use crate::{CpuRuntime, GridCount, KernelArguments, Runtime, ServerError, StreamId, StreamPriority, TimingMethod};

/// A high-priority stream works like any other: its work runs in order, is
/// ordered against other streams by fences both ways, takes fences and
/// syncs, and a failure there marks its outputs and leaves it usable.
pub fn high_priority_streams_behave_like_others<R: Runtime>() {
    let client = first_client::<R>();
    let high = client.with_stream(StreamId::fresh_with_priority(StreamPriority::High));
    let normal = client.with_stream(StreamId::fresh());
    assert_eq!(high.stream_id().priority(), StreamPriority::High);
    assert_eq!(normal.stream_id().priority(), StreamPriority::Normal);
    let n = 1 << 16;
    let values: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
    let h = upload(&high, &values);
    for _ in 0..4 {
        high.launch(&kernels::scale(), GridCount::cover(n, 256), scale_args(&h, 2.0)).unwrap();
    }
    let expect = |f: f32| values.iter().map(|v| v * f).collect::<Vec<f32>>();
    assert_eq!(download(&normal, &h), expect(16.0), "a normal stream sees the high-priority stream's writes");
    normal.launch(&kernels::scale(), GridCount::cover(n, 256), scale_args(&h, 0.5)).unwrap();
    assert_eq!(download(&high, &h), expect(8.0), "and the other way round");
    high.launch(&kernels::scale(), GridCount::cover(n, 256), scale_args(&h, 0.25)).unwrap();
    high.fence().unwrap().wait().unwrap();
    high.sync().unwrap();
    assert_eq!(download(&normal, &h), expect(2.0));
    // A failure marks its outputs, names the kernel, and the stream goes on.
    let bad = upload(&high, &[1.0; 4]);
    high.launch(&kernels::failing(), GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&bad)).unwrap();
    let err = high.read_one(bad.clone()).unwrap_err();
    assert!(matches!(err, ServerError::KernelFailed { .. }) && err.to_string().contains("failing"), "{err}");
    let err = normal.read_one(bad).unwrap_err();
    assert!(err.to_string().contains("failing"), "another stream reads the same cause: {err}");
    let fine = upload(&high, &[1.0; 4]);
    high.launch(&kernels::scale(), GridCount::cover(4, 256), scale_args(&fine, 5.0)).unwrap();
    assert_eq!(download(&high, &fine), vec![5.0; 4]);
    high.sync().unwrap();
    // Each call makes a new stream.
    let other = StreamId::fresh_with_priority(StreamPriority::High);
    assert_ne!(other, high.stream_id());
}

/// Timestamps follow stream order on one timebase across streams: a stamp
/// after work is not before one queued ahead of it, a stamp on a stream that
/// waited for another's work is not before that work, the origin reads 0;
/// CUDA takes them on the device, the CPU and wgpu on the host. A
/// timestamp of another device is refused, naming the device.
pub fn timestamps_follow_stream_order<R: Runtime>() {
    let client = first_client::<R>();
    let a = client.with_stream(StreamId::fresh());
    let b = client.with_stream(StreamId::fresh_with_priority(StreamPriority::High));
    let n = 1 << 18;
    let h = upload(&a, &vec![1.0; n]);
    a.sync().unwrap();
    let t0 = a.timestamp().unwrap();
    for _ in 0..8 {
        a.launch(&kernels::scale(), GridCount::cover(n, 256), scale_args(&h, 2.0)).unwrap();
    }
    let t1 = a.timestamp().unwrap();
    // Ordered after a's launches by a fence (the buffer's last writer).
    b.launch(&kernels::scale(), GridCount::cover(n, 256), scale_args(&h, 2.0)).unwrap();
    let t2 = b.timestamp().unwrap();
    assert_eq!(t2.stream(), b.stream_id());
    assert_eq!(t2.service_id(), client.service_id());
    let (ms, method) = b.timestamps_since(&t0, &[&t1, &t2, &t0]).unwrap();
    assert_eq!(ms.len(), 3);
    assert!(ms[0] >= 0.0, "a stamp after work is not before the origin: {ms:?}");
    assert!(ms[1] >= ms[0], "a stamp behind a fence is not before the work it waited for: {ms:?}");
    assert_eq!(ms[2], 0.0, "the origin from itself");
    let expected = if R::NAME == "cuda" { TimingMethod::Device } else { TimingMethod::Host };
    assert_eq!(method, expected);
    // Reversed: negative.
    let (back, _) = a.timestamps_since(&t2, &[&t0]).unwrap();
    assert!(back[0] <= 0.0, "{back:?}");
    assert_eq!(download(&a, &h), vec![512.0; n]);
    // A stamp of another device.
    let other = if R::NAME == "cpu" { CpuRuntime::client(1).unwrap() } else { CpuRuntime::client(0).unwrap() };
    let foreign = other.timestamp().unwrap();
    let err = a.timestamps_since(&t0, &[&t1, &foreign]).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("timestamp 1") && text.contains(&other.service_id().to_string()), "{text}");
    let err = a.timestamps_since(&foreign, &[&t1]).unwrap_err();
    assert!(err.to_string().contains("the origin"), "{err}");
    // Inside a capture window: refused, and the capture goes on.
    let c = client.with_stream(StreamId::fresh());
    let hc = upload(&c, &[1.0; 64]);
    c.sync().unwrap();
    c.start_capture().unwrap();
    let err = c.timestamp().unwrap_err();
    assert!(matches!(err, ServerError::InvalidState { .. }), "{err}");
    c.launch(&kernels::scale(), GridCount::cover(64, 256), scale_args(&hc, 3.0)).unwrap();
    let graph = c.stop_capture().expect("a refused timestamp does not fail the capture");
    graph.replay().unwrap();
    assert_eq!(download(&c, &hc), vec![3.0; 64]);
}
