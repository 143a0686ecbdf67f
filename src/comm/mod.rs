//! The communication layer seen by the model and engine. Owns: the [`Comm`] trait (collectives
//! inside one stage), the [`Link`] trait (messages between stages, job-wide agreement), their
//! single-rank implementation [`Single`] and the MPI one in [`mpi`]. Callers never see MPI types.
//! Every call is made from the main thread.

pub mod mpi;

/// Time spent inside communication calls so far (waiting included), by kind, in nanoseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommTimes {
    pub allreduce_ns: u64,
    pub allgather_ns: u64,
    /// Point-to-point sends and receives (and the plan broadcast inside a stage).
    pub p2p_ns: u64,
}

impl CommTimes {
    pub fn total_ns(&self) -> u64 {
        self.allreduce_ns + self.allgather_ns + self.p2p_ns
    }
}

impl std::ops::Add for CommTimes {
    type Output = CommTimes;
    fn add(self, o: CommTimes) -> CommTimes {
        CommTimes {
            allreduce_ns: self.allreduce_ns + o.allreduce_ns,
            allgather_ns: self.allgather_ns + o.allgather_ns,
            p2p_ns: self.p2p_ns + o.p2p_ns,
        }
    }
}

impl std::ops::Sub for CommTimes {
    type Output = CommTimes;
    fn sub(self, o: CommTimes) -> CommTimes {
        CommTimes {
            allreduce_ns: self.allreduce_ns - o.allreduce_ns,
            allgather_ns: self.allgather_ns - o.allgather_ns,
            p2p_ns: self.p2p_ns - o.p2p_ns,
        }
    }
}

/// Collective operations inside one group of ranks (a stage's tensor-parallel ranks).
pub trait Comm {
    /// Rank inside this group.
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Element-wise sum over the group, result on every rank.
    fn allreduce_sum(&self, buf: &mut [f32]);
    /// Every rank contributes `mine` (same length everywhere); `out` gets them in rank order.
    fn allgather(&self, mine: &[f32], out: &mut [f32]);
    /// Rank `i` contributes `counts[i]` values; `out` gets them concatenated in rank order.
    fn allgatherv(&self, mine: &[f32], counts: &[usize], out: &mut [f32]);
    /// `buf` of rank 0 is copied to every rank of the group (others' length adjusts).
    fn broadcast_bytes(&self, buf: &mut Vec<u8>);
    /// Time spent in this group's calls so far.
    fn times(&self) -> CommTimes {
        CommTimes::default()
    }
}

/// Message kinds between ranks, so a message can never be taken for another.
#[derive(Debug, Clone, Copy)]
pub enum Tag {
    Plan = 1,
    Hidden = 2,
    Result = 3,
    /// The driver's call to ranks asleep while it has no work ([`Link::sleep_until_woken`]).
    Wake = 4,
}

/// Job-wide operations: point-to-point messages between world ranks and agreement on errors.
pub trait Link {
    fn world_rank(&self) -> usize;
    fn world_size(&self) -> usize;
    fn send_bytes(&self, dest: usize, tag: Tag, data: &[u8]);
    /// Receives a message of any length into `buf` (resized to it; its allocation is reused).
    fn recv_bytes(&self, src: usize, tag: Tag, buf: &mut Vec<u8>);
    fn send_f32(&self, dest: usize, tag: Tag, data: &[f32]);
    fn recv_f32(&self, src: usize, tag: Tag, out: &mut [f32]);
    /// Every rank contributes `mine` (same length); `out` gets all of them in world-rank order.
    fn allgather_u64(&self, mine: &[u64], out: &mut [u64]);
    /// Collective: every rank passes its own outcome of a phase and every rank gets the same
    /// answer — the error of the lowest failing rank (prefixed with that rank when there are
    /// several), or `Ok`. No rank is left waiting on one that failed.
    fn agree(&self, outcome: Result<(), String>) -> Result<(), String>;
    /// Waits for an empty [`Tag::Wake`] message from `src`, napping between looks (a job
    /// with nothing to do keeps no core busy, as a blocking receive's polling would).
    fn sleep_until_woken(&self, src: usize);
    /// Time spent in point-to-point calls so far.
    fn times(&self) -> CommTimes {
        CommTimes::default()
    }
}

/// A job of one rank: every collective is the identity.
pub struct Single;

impl Comm for Single {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn allreduce_sum(&self, _buf: &mut [f32]) {}
    fn allgather(&self, mine: &[f32], out: &mut [f32]) {
        out.copy_from_slice(mine);
    }
    fn allgatherv(&self, mine: &[f32], _counts: &[usize], out: &mut [f32]) {
        out.copy_from_slice(mine);
    }
    fn broadcast_bytes(&self, _buf: &mut Vec<u8>) {}
}

impl Link for Single {
    fn world_rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn send_bytes(&self, dest: usize, _tag: Tag, _data: &[u8]) {
        unreachable!("a single-rank job sends to no rank (asked for {dest})")
    }
    fn recv_bytes(&self, src: usize, _tag: Tag, _buf: &mut Vec<u8>) {
        unreachable!("a single-rank job receives from no rank (asked for {src})")
    }
    fn send_f32(&self, dest: usize, _tag: Tag, _data: &[f32]) {
        unreachable!("a single-rank job sends to no rank (asked for {dest})")
    }
    fn recv_f32(&self, src: usize, _tag: Tag, _out: &mut [f32]) {
        unreachable!("a single-rank job receives from no rank (asked for {src})")
    }
    fn allgather_u64(&self, mine: &[u64], out: &mut [u64]) {
        out.copy_from_slice(mine);
    }
    fn sleep_until_woken(&self, src: usize) {
        unreachable!("a single-rank job is woken by no rank (asked for {src})")
    }
    fn agree(&self, outcome: Result<(), String>) -> Result<(), String> {
        outcome
    }
}
