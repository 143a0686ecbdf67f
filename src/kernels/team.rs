//! A team of kernel threads that stays awake through a model step: the OpenMP role in xFT.
//!
//! A decode step of a small model is ~150 parallel kernels of a few tens of microseconds each.
//! Waking sleeping threads for each (as a work-stealing pool does once its workers park) costs
//! a sizeable part of the step, so team workers spin between kernels, then yield the core, and
//! only after a few milliseconds without work do they sleep. The thread that owns the team is
//! worker 0 and runs its share of every kernel itself, so MPI calls between kernels stay on it.
//!
//! A model step runs as one region ([`Team::region`]): every thread runs the whole step, and
//! its kernels ([`Region::for_ranges`]) are separated by barriers, not each published to the
//! team and joined by the owner (a publish and a join cross between cores one after the other;
//! a barrier's crossings happen at once).
//!
//! The hot path takes no locks and allocates nothing: a kernel is published by writing a
//! pointer and bumping an epoch counter; completion is a counter the caller spins on.

use crossbeam_utils::CachePadded;
use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins, then yields, before it sleeps.
const SPIN: Duration = Duration::from_micros(50);
const YIELD: Duration = Duration::from_millis(3);

type Job = *const (dyn Fn(usize) + Sync);

struct Inner {
    threads: usize,
    /// Bumped once per published kernel.
    epoch: AtomicU64,
    /// The current kernel; written only by worker 0 while every other worker is idle.
    job: UnsafeCell<Option<Job>>,
    /// Workers (other than 0) still running the current kernel.
    pending: AtomicUsize,
    panicked: AtomicBool,
    stop: AtomicBool,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written by the owner only while no worker reads it (between kernels, when
// `pending` is zero) and read by workers only after observing the epoch bump (Acquire).
unsafe impl Sync for Inner {}
unsafe impl Send for Inner {}

pub struct Team {
    inner: Arc<Inner>,
    workers: Vec<JoinHandle<()>>,
    /// One range per thread for [`Region::for_ranges`] (and so [`Team::for_ranges`]): a tag
    /// (see there), then `front` and `back`, 24 bits each. Each on its own cache lines: a
    /// thread takes every piece of its share with a compare-exchange, and with the shares side
    /// by side each one pulled the line away from the other threads' (in a profile of SmolLM2
    /// decode on the 2-core test machine, this loop fell from 1.8% of the samples to 0.3–0.4%
    /// once the shares were padded).
    shares: Box<[CachePadded<AtomicU64>]>,
    /// Calls of [`Region::for_ranges`] each thread has made.
    calls: Box<[CachePadded<AtomicU64>]>,
    /// Barriers each thread has passed ([`Region::barrier`]), each on its own cache lines.
    arrived: Box<[CachePadded<AtomicU64>]>,
}

impl Team {
    /// A team of `threads` (at least 1); the calling thread is worker 0. Its threads'
    /// allocations are counted ([`crate::allocs`]).
    pub fn new(threads: usize) -> std::io::Result<Team> {
        crate::allocs::count_this_thread();
        let threads = threads.max(1);
        let inner = Arc::new(Inner {
            threads,
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            pending: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut workers = Vec::with_capacity(threads - 1);
        for tid in 1..threads {
            let inner = inner.clone();
            let h = std::thread::Builder::new().name(format!("gridlm-kernel-{tid}")).spawn(move || {
                crate::allocs::count_this_thread();
                worker(&inner, tid)
            })?;
            workers.push(h);
        }
        let padded = |v| (0..threads).map(|_| CachePadded::new(AtomicU64::new(v))).collect();
        Ok(Team { inner, workers, shares: padded(STALE), calls: padded(0), arrived: padded(0) })
    }

    pub fn threads(&self) -> usize {
        self.inner.threads
    }

    /// Runs `f(tid)` on every worker, `tid` in `0..threads`, and returns when all are done.
    /// Must be called from the thread that made the team.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        let inner = &*self.inner;
        if inner.threads == 1 {
            f(0);
            return;
        }
        // SAFETY: no worker is running a kernel (the previous `run` waited for all of them), so
        // nobody reads `job` now. The pointer outlives its use: this call does not return
        // until `pending` is zero, i.e. until every worker has finished calling it.
        unsafe {
            let job: Job = std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f);
            *inner.job.get() = Some(job);
        }
        inner.pending.store(inner.threads - 1, SeqCst);
        inner.epoch.fetch_add(1, SeqCst);
        if inner.sleepers.load(SeqCst) > 0 {
            let _g = inner.lock.lock().unwrap_or_else(|e| e.into_inner());
            inner.wake.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| f(0)));
        if mine.is_err() {
            // Workers waiting for this thread at a region's barrier give up.
            inner.panicked.store(true, SeqCst);
        }
        let t0 = Instant::now();
        let mut n = 0u32;
        while inner.pending.load(Acquire) != 0 {
            n = n.wrapping_add(1);
            if n.is_multiple_of(64) && t0.elapsed() > SPIN {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        if inner.panicked.swap(false, SeqCst) {
            // A region may have stopped with its threads at different barriers: start the
            // next one from a clean count.
            self.arrived.iter().chain(self.calls.iter()).for_each(|a| a.store(0, SeqCst));
            self.shares.iter().for_each(|s| s.store(STALE, SeqCst));
            if let Err(p) = mine {
                std::panic::resume_unwind(p);
            }
            panic!("a kernel thread panicked");
        }
    }

    /// Runs `f` on every thread of the team at once, each with its own [`Region`] handle, and
    /// returns when all are done: a whole model step in one dispatch, its kernels separated by
    /// barriers instead of a dispatch and a join each. Every thread must make the same
    /// sequence of collective calls ([`Region::barrier`], [`Region::for_ranges`]). Must be
    /// called from the thread that made the team, which is the region's thread 0.
    pub fn region(&self, f: &(dyn Fn(&Region) + Sync)) {
        self.run(&|tid| f(&Region { team: self, tid }))
    }
}

impl Team {
    /// Calls `f` on ranges that together cover `0..n` once, spread over the team. Thread `t`
    /// owns the `t`-th contiguous share of `0..n` and takes it from the front in shrinking
    /// pieces (a quarter of what it has left, never less than `min`), so its pieces follow
    /// each other in memory and its weight stream never restarts. A thread whose share is
    /// done moves the back half of the largest share left to its own and goes on there, so a
    /// thread that is slow or descheduled does not hold up the kernel. (A region of one call
    /// of [`Region::for_ranges`], whose join is the barrier.)
    pub fn for_ranges(&self, n: usize, min: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        self.ranges_by(n, min, Pieces::Quarters, f)
    }

    /// [`Team::for_ranges`] for kernels that stream their ranges from memory: pieces of half
    /// of what a thread has left (never less than `min`), not a quarter, so fewer of them, each
    /// a stream started anew (see `Pieces`).
    pub fn for_streams(&self, n: usize, min: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        self.ranges_by(n, min, Pieces::Halves, f)
    }

    fn ranges_by(&self, n: usize, min: usize, pieces: Pieces, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        if self.inner.threads == 1 || n <= min {
            if n > 0 {
                f(0..n);
            }
            return;
        }
        self.region(&|r| r.take_ranges(n, min, pieces, f));
    }
}

/// How much of what is left of its share a thread takes as its next piece in
/// [`Region::for_ranges`] and [`Region::for_streams`] (never less than their `min`).
///
/// Every piece a one-token product takes starts a stream from memory where none was running
/// (a long one reads its panels as streams side by side, each beginning a part further along
/// the piece), so the fewer pieces the fewer cold starts. On the 2-core Zen 3 machine, SmolLM2's
/// decode steps (bf16, one token, 121 products of 0.7–3.5 MB and the 56 MB head), taken in
/// turn with halves and quarters within one run, took 2–5% less time with halves (pieces of
/// at least 64 KiB, [`super::packed`]); the whole share at once took 1.5% more than halves
/// (nothing left to even out the threads' ends but the other's share), and llama-3.2-1b's
/// larger products the same time either way (its int8 products 1–2% less with halves).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pieces {
    /// A quarter: the default, finer pieces to even out the threads' ends.
    Quarters,
    /// A half: fewer pieces, for kernels bound by their streams from memory.
    Halves,
}

impl Pieces {
    /// The next piece's length from a share of `left` items, at least `min` (and at most
    /// `left`).
    fn next(self, left: usize, min: usize) -> usize {
        let part = match self {
            Pieces::Quarters => left / 4,
            Pieces::Halves => left / 2,
        };
        part.max(min).min(left)
    }
}

/// A share of [`Region::for_ranges`] that belongs to no call (its tag, 0xFFFF, is none's).
const STALE: u64 = u64::MAX;

/// One thread's handle on a [`Team::region`].
pub struct Region<'a> {
    team: &'a Team,
    tid: usize,
}

impl Region<'_> {
    /// This thread's index, 0 (the team's owner, where MPI calls go) to `threads() - 1`.
    pub fn tid(&self) -> usize {
        self.tid
    }

    pub fn threads(&self) -> usize {
        self.team.inner.threads
    }

    /// This thread's contiguous share of `0..n` when it is split evenly over the threads.
    pub fn share(&self, n: usize) -> std::ops::Range<usize> {
        let t = self.threads();
        self.tid * n / t..(self.tid + 1) * n / t
    }

    /// Waits until every thread of the region has reached this barrier; what each wrote
    /// before it is then visible to all. Each thread announces its arrival on its own cache
    /// line and reads the others': on two cores that is one crossing each way, at once.
    pub fn barrier(&self) {
        let team = self.team;
        let threads = self.threads();
        if threads == 1 {
            return;
        }
        let mine = &team.arrived[self.tid];
        let goal = mine.load(Relaxed) + 1;
        mine.store(goal, Release);
        let t0 = Instant::now();
        let mut n = 0u32;
        for a in team.arrived.iter() {
            while a.load(Acquire) < goal {
                n = n.wrapping_add(1);
                if !n.is_multiple_of(64) {
                    std::hint::spin_loop();
                    continue;
                }
                if team.inner.panicked.load(Relaxed) {
                    panic!("another kernel thread panicked");
                }
                if t0.elapsed() > SPIN {
                    // MPI on thread 0, or more threads than cores: leave the core to them.
                    std::thread::yield_now();
                }
            }
        }
    }

    /// Collective: every thread calls it with the same `n` and `min`. Calls `f` on ranges
    /// that together cover `0..n` once, as [`Team::for_ranges`] does (each thread streams its
    /// own contiguous share in shrinking pieces, then takes over half of the largest share
    /// left), and returns after a barrier, when every range is done.
    ///
    /// There is no owner to set the shares before a call, so each share is tagged with the
    /// call it belongs to (the number of calls its thread had made, modulo 2^15: the same for
    /// every thread of a call, and one more than the last call's). A thread meeting a share
    /// with an older tag, its own or another's, first resets it to that thread's share of this
    /// call: a thread that arrives late finds its share already started by the others.
    pub fn for_ranges(&self, n: usize, min: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        self.take_ranges(n, min, Pieces::Quarters, f);
        self.barrier();
    }

    /// Collective: [`Region::for_ranges`] for kernels that stream their ranges from memory,
    /// each thread taking half of what it has left at a time, as [`Team::for_streams`].
    pub fn for_streams(&self, n: usize, min: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        self.take_ranges(n, min, Pieces::Halves, f);
        self.barrier();
    }

    /// [`Region::for_ranges`] without its barrier, its pieces cut as `pieces` says: returns
    /// when this thread finds nothing left to take, while others may still be running their
    /// last ranges.
    fn take_ranges(&self, n: usize, min: usize, pieces: Pieces, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        let threads = self.threads();
        if threads == 1 {
            if n > 0 {
                f(0..n);
            }
            return;
        }
        assert!(n < 1 << 24, "for_ranges: {n} items");
        let min = min.max(1);
        let calls = &self.team.calls[self.tid];
        let tag = calls.load(Relaxed) & 0x7FFF;
        calls.store(tag + 1, Relaxed);
        let pack = |a: usize, b: usize| (tag << 48) | ((a as u64) << 24) | b as u64;
        let unpack = |v: u64| (((v >> 24) & 0xFF_FFFF) as usize, (v & 0xFF_FFFF) as usize);
        let shares = &self.team.shares;
        // Share `t` of this call, set first if it still holds an earlier call's.
        let current = |t: usize| {
            let s = &shares[t];
            let mut v = s.load(Relaxed);
            while v >> 48 != tag {
                let fresh = pack(t * n / threads, (t + 1) * n / threads);
                match s.compare_exchange(v, fresh, Relaxed, Relaxed) {
                    Ok(_) => return fresh,
                    Err(now) => v = now,
                }
            }
            v
        };
        let mine = &shares[self.tid];
        let mut cur = current(self.tid);
        loop {
            // Take pieces from the front of this thread's share until it is empty.
            loop {
                let (a, b) = unpack(cur);
                if a >= b {
                    break;
                }
                let end = a + pieces.next(b - a, min);
                match mine.compare_exchange_weak(cur, pack(end, b), Relaxed, Relaxed) {
                    Ok(_) => {
                        f(a..end);
                        cur = mine.load(Relaxed);
                    }
                    Err(now) => cur = now,
                }
            }
            // Then the back half of the largest share left (all of it when no longer than
            // `min`).
            let victim = (0..threads).filter(|&t| t != self.tid).max_by_key(|&t| {
                let (a, b) = unpack(current(t));
                b.saturating_sub(a)
            });
            let Some(victim) = victim else { break };
            let mut v = current(victim);
            let stolen = loop {
                let (a, b) = unpack(v);
                if a >= b {
                    break None;
                }
                let mid = if b - a > min { b - (b - a) / 2 } else { a };
                match shares[victim].compare_exchange_weak(v, pack(a, mid), Relaxed, Relaxed) {
                    Ok(_) => break Some((mid, b)),
                    Err(now) => v = now,
                }
            };
            match stolen {
                // This thread's share is empty and only it takes from its front; thieves find
                // nothing there, so a plain store loses no piece.
                Some((a, b)) => {
                    cur = pack(a, b);
                    mine.store(cur, Relaxed);
                }
                None => {
                    if (0..threads).all(|t| {
                        let (a, b) = unpack(current(t));
                        a >= b
                    }) {
                        break;
                    }
                    cur = mine.load(Relaxed);
                }
            }
        }
    }
}

/// Where a parallel kernel runs: from the team's owner, each call dispatched to the whole
/// team ([`Team`]), or inside a [`Team::region`], each call made by every thread at once
/// ([`Region`]).
pub trait Par {
    fn threads(&self) -> usize;
    /// Calls `f` on ranges that together cover `0..n` once, spread over the threads, pieces
    /// of at least `min` (but the last), and returns when all are done.
    fn for_ranges(&self, n: usize, min: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync));
    /// As `for_ranges`, for kernels that stream their ranges from memory: fewer, larger
    /// pieces ([`Team::for_streams`]).
    fn for_streams(&self, n: usize, min: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync));
}

impl Par for Team {
    fn threads(&self) -> usize {
        Team::threads(self)
    }
    fn for_ranges(&self, n: usize, min: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        Team::for_ranges(self, n, min, f)
    }
    fn for_streams(&self, n: usize, min: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        Team::for_streams(self, n, min, f)
    }
}

impl Par for Region<'_> {
    fn threads(&self) -> usize {
        Region::threads(self)
    }
    fn for_ranges(&self, n: usize, min: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        Region::for_ranges(self, n, min, f)
    }
    fn for_streams(&self, n: usize, min: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        Region::for_streams(self, n, min, f)
    }
}

fn worker(inner: &Inner, tid: usize) {
    let mut seen = 0u64;
    loop {
        let t0 = Instant::now();
        let mut n = 0u32;
        loop {
            if inner.stop.load(Acquire) {
                return;
            }
            let e = inner.epoch.load(Acquire);
            if e != seen {
                seen = e;
                break;
            }
            n = n.wrapping_add(1);
            if !n.is_multiple_of(64) {
                std::hint::spin_loop();
                continue;
            }
            let idle = t0.elapsed();
            if idle < SPIN {
                std::hint::spin_loop();
            } else if idle < YIELD {
                std::thread::yield_now();
            } else {
                let mut g = inner.lock.lock().unwrap_or_else(|e| e.into_inner());
                inner.sleepers.fetch_add(1, SeqCst);
                while inner.epoch.load(SeqCst) == seen && !inner.stop.load(SeqCst) {
                    g = inner.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                inner.sleepers.fetch_sub(1, SeqCst);
            }
        }
        // SAFETY: the owner wrote `job` before bumping the epoch we just observed (Acquire)
        // and keeps the closure alive until we decrement `pending`.
        let job = unsafe { (*inner.job.get()).expect("a kernel was published") };
        if catch_unwind(AssertUnwindSafe(|| unsafe { (*job)(tid) })).is_err() {
            inner.panicked.store(true, SeqCst);
        }
        inner.pending.fetch_sub(1, Release);
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.inner.stop.store(true, SeqCst);
        {
            let _g = self.inner.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.inner.wake.notify_all();
        }
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_everything_once() {
        for threads in [1, 2, 3] {
            let team = Team::new(threads).unwrap();
            for (n, min) in [(0, 1), (1, 4), (7, 2), (1000, 3), (4096, 1)] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                team.for_ranges(n, min, &|r| {
                    assert!(!r.is_empty());
                    r.for_each(|i| {
                        hits[i].fetch_add(1, Relaxed);
                    });
                });
                assert!(hits.iter().all(|h| h.load(Relaxed) == 1), "threads {threads} n {n}");
            }
        }
    }

    #[test]
    fn ranges_cover_everything_once_when_one_thread_is_slow() {
        // The thread that owns the team stalls in each of its pieces, so the others run out
        // first and take over the rest of its share (and each other's).
        for (threads, streams) in [(2, false), (3, false), (2, true), (3, true)] {
            let team = Team::new(threads).unwrap();
            let owner = std::thread::current().id();
            let n = 600;
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            let f = |r: std::ops::Range<usize>| {
                if std::thread::current().id() == owner {
                    std::thread::sleep(Duration::from_millis(2));
                }
                r.for_each(|i| {
                    hits[i].fetch_add(1, Relaxed);
                });
            };
            if streams {
                team.for_streams(n, 1, &f);
            } else {
                team.for_ranges(n, 1, &f);
            }
            assert!(hits.iter().all(|h| h.load(Relaxed) == 1), "threads {threads}, streams {streams}");
        }
    }

    #[test]
    fn a_thread_takes_quarters_or_halves_of_its_share() {
        // The other thread sleeps in its first piece, long enough that the owner takes every
        // piece of its own share before anyone else can reach it.
        let own_pieces = |halves: bool| -> Vec<std::ops::Range<usize>> {
            let (mut a, mut out) = (0, Vec::new());
            while a < 500 {
                let left = 500 - a;
                let len = (if halves { left / 2 } else { left / 4 }).max(3).min(left);
                out.push(a..a + len);
                a += len;
            }
            out
        };
        assert_eq!(own_pieces(true)[..3], [0..250, 250..375, 375..437]);
        assert_eq!(own_pieces(false)[..3], [0..125, 125..218, 218..288]);
        for halves in [false, true] {
            let team = Team::new(2).unwrap();
            let owner = std::thread::current().id();
            let taken = Mutex::new(Vec::new());
            let f = |r: std::ops::Range<usize>| {
                if std::thread::current().id() == owner {
                    taken.lock().unwrap().push(r);
                } else if r.start == 500 {
                    std::thread::sleep(Duration::from_millis(100));
                }
            };
            if halves {
                team.for_streams(1000, 3, &f);
            } else {
                team.for_ranges(1000, 3, &f);
            }
            let taken = taken.into_inner().unwrap();
            let own = own_pieces(halves);
            assert_eq!(taken[..own.len()], own, "halves {halves}");
        }
    }

    #[test]
    fn sleeping_workers_wake_up() {
        let team = Team::new(2).unwrap();
        let seen = AtomicUsize::new(0);
        std::thread::sleep(YIELD * 3);
        team.run(&|_| {
            seen.fetch_add(1, Relaxed);
        });
        assert_eq!(seen.load(Relaxed), 2);
    }

    #[test]
    fn a_panicking_kernel_reaches_the_caller() {
        let team = Team::new(2).unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| team.run(&|tid| assert_ne!(tid, 1, "boom"))));
        assert!(r.is_err());
        // The team still works afterwards.
        let c = AtomicUsize::new(0);
        team.run(&|_| {
            c.fetch_add(1, Relaxed);
        });
        assert_eq!(c.load(Relaxed), 2);
    }

    #[test]
    fn region_ranges_cover_everything_once_call_after_call() {
        // Many collective calls in one region and over several regions, one thread often late
        // to a call (the others then start its share), with barriers between writes and reads.
        for threads in [1, 2, 3] {
            let team = Team::new(threads).unwrap();
            let sizes = [0usize, 1, 7, 64, 1000, 3];
            let hits: Vec<Vec<AtomicUsize>> =
                sizes.iter().map(|&n| (0..n).map(|_| AtomicUsize::new(0)).collect()).collect();
            for round in 0..20 {
                team.region(&|r| {
                    for (k, &n) in sizes.iter().enumerate() {
                        if (r.tid() + round + k) % 3 == 0 {
                            std::thread::sleep(Duration::from_micros(200));
                        }
                        let f = |range: std::ops::Range<usize>| {
                            range.for_each(|i| {
                                hits[k][i].fetch_add(1, Relaxed);
                            });
                        };
                        if (round + k) % 2 == 0 {
                            r.for_ranges(n, 2, &f);
                        } else {
                            r.for_streams(n, 2, &f);
                        }
                        // Every range of the call is done when it returns, on every thread.
                        assert!(hits[k].iter().all(|h| h.load(Relaxed) == round + 1));
                        r.barrier();
                    }
                });
            }
        }
    }

    #[test]
    fn region_barrier_publishes_what_each_thread_wrote() {
        let team = Team::new(3).unwrap();
        let slots: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
        team.region(&|r| {
            for step in 1..200 {
                slots[r.tid()].store(step * 10 + r.tid(), Relaxed);
                r.barrier();
                for (t, s) in slots.iter().enumerate() {
                    assert_eq!(s.load(Relaxed), step * 10 + t);
                }
                r.barrier();
            }
        });
    }

    #[test]
    fn a_panic_in_a_region_reaches_the_caller_and_frees_the_others() {
        // Thread 1 panics while the others wait for it at a barrier: they give up, the caller
        // gets the panic, and the next region starts from a clean count.
        for victim in [0, 1] {
            let team = Team::new(3).unwrap();
            let r = catch_unwind(AssertUnwindSafe(|| {
                team.region(&|r| {
                    r.barrier();
                    assert_ne!(r.tid(), victim, "boom");
                    r.barrier();
                })
            }));
            assert!(r.is_err());
            let c = AtomicUsize::new(0);
            team.region(&|r| {
                r.for_ranges(100, 1, &|range| {
                    c.fetch_add(range.len(), Relaxed);
                });
            });
            assert_eq!(c.load(Relaxed), 100);
        }
    }
}
