//! The communication layer seen by the model and engine. Owns: the [`Comm`] trait and its
//! single-rank implementation. Callers never see MPI types.

/// Collective operations inside one group of ranks (a stage's tensor-parallel ranks), plus
/// point-to-point messages on the whole job. All calls are made from the main thread.
pub trait Comm {
    /// Rank inside this group.
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Element-wise sum over the group, result on every rank.
    fn allreduce_sum(&self, buf: &mut [f32]);
    /// Every rank contributes `mine` (same length everywhere); `out` gets them in rank order.
    fn allgather(&self, mine: &[f32], out: &mut [f32]);
}

/// A group of one rank: every collective is the identity.
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
}
