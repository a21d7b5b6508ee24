//! [`TeacherData`]: a synthetic regression task whose targets a fixed
//! teacher network makes, so the loss a student can reach is zero.

use cohort_comm::{Buffer, Error};
use cohort_runtime::Client;

use super::{noise, Mlp, MlpConfig};

/// Batches of inputs and the teacher's outputs for the local replicas.
pub struct TeacherData {
    /// Per batch: the inputs, one buffer per local replica (`rows × width`).
    pub inputs: Vec<Vec<Buffer<f32>>>,
    /// Per batch: the targets, one buffer per local replica.
    pub targets: Vec<Vec<Buffer<f32>>>,
}

impl TeacherData {
    /// `batches` global batches of `global_rows` rows. The inputs of global
    /// batch `b` are rows `b × global_rows ..` of a fixed pseudo-random
    /// sequence; the teacher (an [`Mlp`] of `config` from `teacher_seed`,
    /// run on `maker`'s device over each whole global batch) gives the
    /// targets. `clients[l]` is member `first_member + l` of `members` and
    /// gets rows `[member · rows, (member + 1) · rows)` of every global
    /// batch, so every share is cut from the same numbers whatever the
    /// member count. Waits for the teacher.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        maker: &Client,
        clients: &[Client],
        first_member: usize,
        members: usize,
        config: MlpConfig,
        teacher_seed: u64,
        global_rows: usize,
        batches: usize,
    ) -> Result<TeacherData, Error> {
        if members == 0 || !global_rows.is_multiple_of(members) || first_member + clients.len() > members {
            return Err(Error::InvalidArgument(format!(
                "a global batch of {global_rows} rows cannot be split evenly among {members} members: use a member count that divides it"
            )));
        }
        let w = config.width;
        let rows = global_rows / members;
        let mut teacher = Mlp::new(std::slice::from_ref(maker), config, global_rows, teacher_seed)?;
        let (mut inputs, mut targets) = (Vec::with_capacity(batches), Vec::with_capacity(batches));
        for b in 0..batches {
            let first = (b * global_rows * w) as u64;
            let x: Vec<f32> = (0..(global_rows * w) as u64).map(|i| noise(0x5EED_0000_0000 + first + i)).collect();
            teacher.forward(&[Buffer::from_slice(maker, &x)?])?;
            let y = teacher.output(0).to_vec()?;
            let (mut xs, mut ys) = (Vec::new(), Vec::new());
            for (l, client) in clients.iter().enumerate() {
                let share = (first_member + l) * rows * w..(first_member + l + 1) * rows * w;
                xs.push(Buffer::from_slice(client, &x[share.clone()])?);
                ys.push(Buffer::from_slice(client, &y[share])?);
            }
            inputs.push(xs);
            targets.push(ys);
        }
        Ok(TeacherData { inputs, targets })
    }
}
