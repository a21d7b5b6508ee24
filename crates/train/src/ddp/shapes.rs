//! The start-up check that every member registered the same parameters:
//! two all-gathers (the count, then each parameter's name and shape), so a
//! rank that differs gets an error naming it and the parameter on every
//! member, instead of a hang or a silent mix-up in the first all-reduce;
//! and a third that every member chose the same bucket layout and hook.

use cohort_comm::{Collectives, Error};

use crate::nn::Parameter;

/// Dimensions a shape may have (the slots of its description).
pub const MAX_DIMS: usize = 6;
/// u64s per parameter: name hash, dimension count, dimensions.
const WORDS: usize = 2 + MAX_DIMS;

/// FNV-1a of a name: the same on every machine and build.
fn name_hash(name: &str) -> u64 {
    cohort_comm::digest::Fnv1a::of(name.bytes())
}

fn describe(params: &[Parameter]) -> Vec<u64> {
    let mut words = Vec::with_capacity(params.len() * WORDS);
    for p in params {
        words.push(name_hash(&p.name));
        words.push(p.shape.len() as u64);
        words.extend((0..MAX_DIMS).map(|d| p.shape.get(d).map_or(0, |&v| v as u64)));
    }
    words
}

fn shape_of(words: &[u64]) -> Vec<u64> {
    words[2..2 + (words[1] as usize).min(MAX_DIMS)].to_vec()
}

/// Which rank holds `member` (members are numbered rank by rank).
fn rank_of(world: &impl Collectives, member: usize) -> usize {
    member / world.clients().len().max(1)
}

/// Checks that every member of `world` registered the same parameters as
/// member 0 (same count, names and shapes, in order). Waits for two
/// all-gathers; every member returns the same verdict.
pub fn check_same_everywhere(world: &impl Collectives, params: &[Parameter]) -> Result<(), Error> {
    let n = world.members();
    let counts = world.zeros::<u64>(n)?;
    let mine = world.replicate(&[params.len() as u64])?;
    world.all_gather(&mine, &counts)?;
    let counts = counts[0].to_vec()?;
    if let Some(m) = counts.iter().position(|&c| c != counts[0]) {
        return Err(Error::InvalidArgument(format!(
            "DistributedDataParallel: rank {} (member {m}) registers {} parameters, but rank 0 registers {}: every rank must register the same parameters in the same order",
            rank_of(world, m),
            counts[m],
            counts[0]
        )));
    }
    if params.is_empty() {
        return Ok(());
    }
    let words = describe(params);
    let all = world.zeros::<u64>(n * words.len())?;
    world.all_gather(&world.replicate(&words)?, &all)?;
    let all = all[0].to_vec()?;
    let reference = &all[..words.len()];
    for m in 1..n {
        let theirs = &all[m * words.len()..(m + 1) * words.len()];
        for (i, p) in params.iter().enumerate() {
            let (a, b) = (&reference[i * WORDS..(i + 1) * WORDS], &theirs[i * WORDS..(i + 1) * WORDS]);
            if a == b {
                continue;
            }
            let same_name = a[0] == b[0];
            let local = words[i * WORDS] == b[0];
            return Err(Error::InvalidArgument(format!(
                "DistributedDataParallel: rank {} (member {m}) registers parameter {i}{} with shape {:?}, but rank 0 registers {}with shape {:?}: every rank must register the same parameters, with the same shapes, in the same order",
                rank_of(world, m),
                if local { format!(" `{}`", p.name) } else { String::new() },
                shape_of(b),
                if same_name { format!("`{}` ", p.name) } else { "a parameter named differently ".into() },
                shape_of(a),
            )));
        }
    }
    Ok(())
}

/// Checks that every member of `world` gives the same `settings` (named by
/// `names`, in order: what decides the bucket layout and how a bucket is
/// communicated) as member 0. Waits for one all-gather; every member
/// returns the same verdict.
pub fn check_same_settings(world: &impl Collectives, names: &[&str], settings: &[u64]) -> Result<(), Error> {
    let n = world.members();
    let all = world.zeros::<u64>(n * settings.len())?;
    world.all_gather(&world.replicate(settings)?, &all)?;
    let all = all[0].to_vec()?;
    let reference = &all[..settings.len()];
    for m in 1..n {
        let theirs = &all[m * settings.len()..(m + 1) * settings.len()];
        if let Some(i) = (0..settings.len()).find(|&i| theirs[i] != reference[i]) {
            return Err(Error::InvalidArgument(format!(
                "DistributedDataParallel: rank {} (member {m}) sets {} to {}, but rank 0 sets it to {}: every rank must use the same DdpOptions (they decide the buckets every rank all-reduces)",
                rank_of(world, m),
                names[i],
                theirs[i],
                reference[i]
            )));
        }
    }
    Ok(())
}
