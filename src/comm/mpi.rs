//! [`Comm`] and [`Link`] over MPI (rsmpi). Owns: MPI initialisation (funneled: only the main
//! thread calls MPI), the world communicator and the stage communicator split from it.

use super::{Comm, CommTimes, Link, Tag};
use crate::error::{Error, Result};
use mpi::datatype::PartitionMut;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;
use std::cell::{Cell, RefCell};
use std::time::Instant;

/// Adds the time `f` takes to `slot`.
fn timed<T>(slot: &Cell<u64>, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let r = f();
    slot.set(slot.get() + t.elapsed().as_nanos() as u64);
    r
}

/// True when this process was started by an MPI launcher (Open MPI, MPICH/Hydra, PMIx).
pub fn launched_by_mpirun() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

/// The first of the launcher's variables `vars` (Open MPI's, then MPICH/Hydra's) set to a number.
fn launcher_number(vars: [&str; 2]) -> Option<usize> {
    vars.iter().find_map(|v| std::env::var(v).ok()?.parse::<usize>().ok())
}

/// This rank's index among the ranks on its node, as the launcher says (0 without one).
pub fn local_rank() -> usize {
    launcher_number(["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"]).unwrap_or(0)
}

/// Ranks of this job on this node, as the launcher says (1 without one).
pub fn local_ranks() -> usize {
    launcher_number(["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"]).unwrap_or(1).max(1)
}

/// The MPI job: keep it alive for all of `main` (dropping it finalizes MPI).
pub struct MpiJob {
    world: SimpleCommunicator,
    _universe: mpi::environment::Universe,
}

impl MpiJob {
    pub fn init() -> Result<Self> {
        let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Funneled)
            .ok_or_else(|| Error::Comm("MPI was already initialised".into()))?;
        if threading < mpi::Threading::Funneled {
            return Err(Error::Comm(format!("MPI offers thread level {threading:?}; gridlm needs Funneled")));
        }
        Ok(MpiJob { world: universe.world(), _universe: universe })
    }

    pub fn rank(&self) -> usize {
        self.world.rank() as usize
    }
    pub fn size(&self) -> usize {
        self.world.size() as usize
    }

    /// The stage communicator (ranks with the same `stage`, ordered by `tp_rank`) and the
    /// job-wide link. Collective over the world.
    pub fn split(&self, stage: usize, tp_rank: usize) -> (MpiStage, MpiLink<'_>) {
        let stage_comm = self
            .world
            .split_by_color_with_key(Color::with_value(stage as i32), tp_rank as i32)
            .expect("every rank passes a colour, so every rank gets a communicator");
        let stage = MpiStage { comm: stage_comm, send: RefCell::new(Vec::new()), times: Default::default() };
        (stage, MpiLink { world: &self.world, p2p: Cell::new(0) })
    }
}

pub struct MpiStage {
    comm: SimpleCommunicator,
    /// rsmpi has no MPI_IN_PLACE: allreduce sends from this copy (grown, never shrunk).
    send: RefCell<Vec<f32>>,
    /// Time inside allreduce, allgather and broadcast.
    times: [Cell<u64>; 3],
}

fn displacements(counts: &[i32]) -> Vec<i32> {
    counts
        .iter()
        .scan(0, |acc, &c| {
            let d = *acc;
            *acc += c;
            Some(d)
        })
        .collect()
}

impl Comm for MpiStage {
    fn rank(&self) -> usize {
        self.comm.rank() as usize
    }
    fn size(&self) -> usize {
        self.comm.size() as usize
    }
    fn allreduce_sum(&self, buf: &mut [f32]) {
        let mut send = self.send.borrow_mut();
        crate::grow(&mut send, buf.len());
        send[..buf.len()].copy_from_slice(buf);
        timed(&self.times[0], || {
            self.comm.all_reduce_into(&send[..buf.len()], buf, mpi::collective::SystemOperation::sum())
        });
    }
    fn allgather(&self, mine: &[f32], out: &mut [f32]) {
        timed(&self.times[1], || self.comm.all_gather_into(mine, out));
    }
    fn allgatherv(&self, mine: &[f32], counts: &[usize], out: &mut [f32]) {
        let counts: Vec<i32> = counts.iter().map(|&c| c as i32).collect();
        let displs = displacements(&counts);
        let mut part = PartitionMut::new(out, &counts[..], &displs[..]);
        timed(&self.times[1], || self.comm.all_gather_varcount_into(mine, &mut part));
    }
    fn broadcast_bytes(&self, buf: &mut Vec<u8>) {
        let root = self.comm.process_at_rank(0);
        let mut len = buf.len() as u64;
        timed(&self.times[2], || {
            root.broadcast_into(&mut len);
            buf.resize(len as usize, 0);
            root.broadcast_into(&mut buf[..]);
        });
    }
    fn times(&self) -> CommTimes {
        CommTimes {
            allreduce_ns: self.times[0].get(),
            allgather_ns: self.times[1].get(),
            p2p_ns: self.times[2].get(),
        }
    }
}

pub struct MpiLink<'a> {
    world: &'a SimpleCommunicator,
    /// Time inside sends and receives.
    p2p: Cell<u64>,
}

impl Link for MpiLink<'_> {
    fn world_rank(&self) -> usize {
        self.world.rank() as usize
    }
    fn world_size(&self) -> usize {
        self.world.size() as usize
    }
    fn send_bytes(&self, dest: usize, tag: Tag, data: &[u8]) {
        timed(&self.p2p, || self.world.process_at_rank(dest as i32).send_with_tag(data, tag as i32));
    }
    fn recv_bytes(&self, src: usize, tag: Tag, buf: &mut Vec<u8>) {
        timed(&self.p2p, || {
            let (msg, status) = self.world.process_at_rank(src as i32).matched_probe_with_tag(tag as i32);
            let n = status.count(u8::equivalent_datatype());
            // A count of u8 is never MPI_UNDEFINED (every length is a whole number of bytes).
            buf.resize(usize::try_from(n).expect("a byte count is never negative"), 0);
            msg.matched_receive_into(&mut buf[..]);
        })
    }
    fn send_f32(&self, dest: usize, tag: Tag, data: &[f32]) {
        timed(&self.p2p, || self.world.process_at_rank(dest as i32).send_with_tag(data, tag as i32));
    }
    fn recv_f32(&self, src: usize, tag: Tag, out: &mut [f32]) {
        timed(&self.p2p, || self.world.process_at_rank(src as i32).receive_into_with_tag(out, tag as i32));
    }
    fn allgather_u64(&self, mine: &[u64], out: &mut [u64]) {
        self.world.all_gather_into(mine, out);
    }
    fn sleep_until_woken(&self, src: usize) {
        let from = self.world.process_at_rank(src as i32);
        // Naps grow to 2 ms: the first request after a quiet spell waits at most that long.
        let mut nap = std::time::Duration::from_micros(50);
        loop {
            if let Some((msg, _)) = from.immediate_matched_probe_with_tag(Tag::Wake as i32) {
                msg.matched_receive_into(&mut [0u8; 0][..]);
                return;
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(std::time::Duration::from_millis(2));
        }
    }
    fn agree(&self, outcome: Result<(), String>) -> Result<(), String> {
        let msg = outcome.err().unwrap_or_default().into_bytes();
        let n = self.world.size() as usize;
        let mut lens = vec![0i32; n];
        self.world.all_gather_into(&(msg.len() as i32), &mut lens[..]);
        if lens.iter().all(|&l| l == 0) {
            return Ok(());
        }
        let displs = displacements(&lens);
        let mut all = vec![0u8; lens.iter().sum::<i32>() as usize];
        {
            let mut part = PartitionMut::new(&mut all[..], &lens[..], &displs[..]);
            self.world.all_gather_varcount_into(&msg[..], &mut part);
        }
        let first = lens.iter().position(|&l| l > 0).unwrap_or(0);
        let text =
            String::from_utf8_lossy(&all[displs[first] as usize..(displs[first] + lens[first]) as usize]);
        Err(if n > 1 { format!("rank {first}: {text}") } else { text.into_owned() })
    }
    fn times(&self) -> CommTimes {
        CommTimes { p2p_ns: self.p2p.get(), ..CommTimes::default() }
    }
}

impl MpiJob {
    /// Ends every rank of the job (after this rank printed its error).
    pub fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }
}

impl MpiJob {
    /// Waits until every rank of the job is here.
    pub fn barrier(&self) {
        self.world.barrier();
    }
}
