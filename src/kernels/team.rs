//! A team of kernel threads that stays awake through a model step: the OpenMP role in xFT.
//!
//! A decode step of a small model is ~150 parallel kernels of a few tens of microseconds each.
//! Waking sleeping threads for each (as a work-stealing pool does once its workers park) costs
//! a sizeable part of the step, so team workers spin between kernels, then yield the core, and
//! only after a few milliseconds without work do they sleep. The thread that owns the team is
//! worker 0 and runs its share of every kernel itself, so MPI calls between kernels stay on it.
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
    /// One range per thread for [`Team::for_ranges`]: `front << 32 | back`, reset by the
    /// owner before each kernel (so the hot path allocates nothing). Each on its own cache
    /// lines: a thread takes every piece of its share with a compare-exchange, and with the
    /// shares side by side each one pulled the line away from the other threads' (in a
    /// profile of SmolLM2 decode on the 2-core test machine, this loop fell from 1.8% of the
    /// samples to 0.3–0.4% once the shares were padded).
    shares: Box<[CachePadded<AtomicU64>]>,
}

impl Team {
    /// A team of `threads` (at least 1); the calling thread is worker 0.
    pub fn new(threads: usize) -> std::io::Result<Team> {
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
            let h = std::thread::Builder::new()
                .name(format!("gridlm-kernel-{tid}"))
                .spawn(move || worker(&inner, tid))?;
            workers.push(h);
        }
        let shares = (0..threads).map(|_| CachePadded::new(AtomicU64::new(0))).collect();
        Ok(Team { inner, workers, shares })
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
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        if inner.panicked.swap(false, SeqCst) {
            panic!("a kernel thread panicked");
        }
    }

    /// Calls `f(i)` for every `i` in `0..n`, spread over the team: each worker takes the next
    /// index from a shared counter until none are left.
    pub fn for_each(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        if n == 1 || self.inner.threads == 1 {
            (0..n).for_each(f);
            return;
        }
        let next = AtomicUsize::new(0);
        self.run(&|_| loop {
            let i = next.fetch_add(1, Relaxed);
            if i >= n {
                break;
            }
            f(i);
        });
    }
}

impl Team {
    /// Calls `f` on ranges that together cover `0..n` once, spread over the team. Thread `t`
    /// owns the `t`-th contiguous share of `0..n` and takes it from the front in shrinking
    /// pieces (a quarter of what it has left, never less than `min`), so its pieces follow
    /// each other in memory and its weight stream never restarts. A thread whose share is
    /// done moves the back half of the largest share left to its own and goes on there, so a
    /// thread that is slow or descheduled does not hold up the kernel.
    pub fn for_ranges(&self, n: usize, min: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        let threads = self.inner.threads;
        if threads == 1 || n <= min {
            if n > 0 {
                f(0..n);
            }
            return;
        }
        assert!(n < 1 << 32, "for_ranges: {n} items");
        let min = min.max(1);
        let pack = |a: usize, b: usize| ((a as u64) << 32) | b as u64;
        let unpack = |v: u64| ((v >> 32) as usize, (v & 0xFFFF_FFFF) as usize);
        for (t, s) in self.shares.iter().enumerate() {
            s.store(pack(t * n / threads, (t + 1) * n / threads), Relaxed);
        }
        let shares = &self.shares;
        self.run(&|tid| {
            let mine = &shares[tid];
            loop {
                // Take pieces from the front of this thread's share until it is empty.
                let mut cur = mine.load(Relaxed);
                loop {
                    let (a, b) = unpack(cur);
                    if a >= b {
                        break;
                    }
                    let end = (a + ((b - a) / 4).max(min)).min(b);
                    match mine.compare_exchange_weak(cur, pack(end, b), Relaxed, Relaxed) {
                        Ok(_) => {
                            f(a..end);
                            cur = mine.load(Relaxed);
                        }
                        Err(now) => cur = now,
                    }
                }
                // Then move the back half of the largest share left (all of it when it is
                // no longer than `min`) to this thread's own, and go on there.
                let victim = shares.iter().enumerate().filter(|&(t, _)| t != tid).max_by_key(|(_, s)| {
                    let (a, b) = unpack(s.load(Relaxed));
                    b.saturating_sub(a)
                });
                let Some((_, victim)) = victim else { return };
                let mut cur = victim.load(Relaxed);
                let stolen = loop {
                    let (a, b) = unpack(cur);
                    if a >= b {
                        break None;
                    }
                    let mid = if b - a > min { b - (b - a) / 2 } else { a };
                    match victim.compare_exchange_weak(cur, pack(a, mid), Relaxed, Relaxed) {
                        Ok(_) => break Some((mid, b)),
                        Err(now) => cur = now,
                    }
                };
                match stolen {
                    // Only this thread takes from its own front, and its share is empty, so a
                    // plain store cannot lose a piece (thieves find nothing to take from it).
                    Some((a, b)) => mine.store(pack(a, b), Relaxed),
                    None => {
                        // The largest share was emptied meanwhile: done when all are.
                        if shares.iter().all(|s| {
                            let (a, b) = unpack(s.load(Relaxed));
                            a >= b
                        }) {
                            return;
                        }
                    }
                }
            }
        });
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
    fn every_index_once_across_many_kernels() {
        for threads in [1, 2, 3] {
            let team = Team::new(threads).unwrap();
            for n in [0, 1, 5, 100] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                for _ in 0..50 {
                    team.for_each(n, &|i| {
                        hits[i].fetch_add(1, Relaxed);
                    });
                }
                assert!(hits.iter().all(|h| h.load(Relaxed) == 50), "threads {threads} n {n}");
            }
        }
    }

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
        for threads in [2, 3] {
            let team = Team::new(threads).unwrap();
            let owner = std::thread::current().id();
            let n = 600;
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            team.for_ranges(n, 1, &|r| {
                if std::thread::current().id() == owner {
                    std::thread::sleep(Duration::from_millis(2));
                }
                r.for_each(|i| {
                    hits[i].fetch_add(1, Relaxed);
                });
            });
            assert!(hits.iter().all(|h| h.load(Relaxed) == 1), "threads {threads}");
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
}
