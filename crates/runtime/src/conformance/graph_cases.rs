//! Conformance cases for graph capture and replay.

use super::cases::{download, scale_args, upload};
use super::{first_client, kernels};
use crate::{Bytes, GridCount, KernelArguments, Runtime, ServerError, StreamId};

/// Replaying a captured graph gives what running its launches directly gives.
pub fn graph_replay_matches_direct_launches<R: Runtime>() {
    let client = first_client::<R>().with_stream(StreamId::fresh());
    let n = 4096;
    let start: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let direct = upload(&client, &start);
    let captured = upload(&client, &start);
    let other = upload(&client, &vec![1.0; n]);
    let out = client.empty(n * 4);
    let run = |x: &crate::Handle, factor: f32| {
        client.launch(&kernels::scale(), GridCount::cover(n, 256), scale_args(x, factor)).unwrap();
        client
            .launch(
                &kernels::add(),
                GridCount::cover(n, 256),
                KernelArguments::new().buffer(x).buffer(&other).buffer(&out),
            )
            .unwrap();
    };
    client.graph_prepare().unwrap();
    client.write(&captured, Bytes::from_elems(&start)).unwrap();
    client.sync().unwrap();
    client.start_capture().unwrap();
    assert!(client.is_capturing());
    run(&captured, 3.0);
    let graph = client.stop_capture().unwrap();
    assert!(!client.is_capturing());
    assert!(!graph.is_empty());
    if !client.properties().native_graphs {
        assert_eq!(download(&client, &captured), start, "recording ran nothing");
    }
    for _ in 0..3 {
        graph.replay().unwrap();
        run(&direct, 3.0);
    }
    assert_eq!(download(&client, &captured), download(&client, &direct));
    // Inputs refreshed in place between replays are seen by the next replay.
    client.write(&captured, Bytes::from_elems(&vec![1.0f32; n])).unwrap();
    graph.replay().unwrap();
    assert_eq!(download(&client, &captured), vec![3.0; n]);
    assert_eq!(download(&client, &out), vec![4.0; n]);
}

/// Inside a capture window: reads, syncs and fresh allocations are refused,
/// and a capture that saw one fails at `stop_capture`.
pub fn capture_window_refusals<R: Runtime>() {
    let client = first_client::<R>().with_stream(StreamId::fresh());
    let h = upload(&client, &[1.0; 64]);
    client.sync().unwrap();
    client.start_capture().unwrap();
    let state_err = |e: ServerError| assert!(matches!(e, ServerError::InvalidState { .. }), "{e}");
    state_err(client.read_one(h.clone()).unwrap_err());
    state_err(client.sync().unwrap_err());
    state_err(client.start_capture().unwrap_err());
    client.launch(&kernels::scale(), GridCount::cover(64, 256), scale_args(&h, 2.0)).unwrap();
    let graph = client.stop_capture().expect("refused calls do not fail the capture");
    graph.replay().unwrap();
    assert_eq!(download(&client, &h), vec![2.0; 64]);

    client.start_capture().unwrap();
    let fresh = client.empty(64 << 20);
    let err = client.stop_capture().unwrap_err();
    assert!(err.to_string().contains("capture window"), "{err}");
    let read_err = client.read_one(fresh).unwrap_err();
    assert!(read_err.to_string().contains("graph_prepare"), "{read_err}");
    state_err(client.stop_capture().unwrap_err());
    client.sync().unwrap();
}
