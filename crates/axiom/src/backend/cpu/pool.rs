//! A persistent pool of worker threads for the CPU kernels.
//!
//! `run` hands one closure to every thread (the caller is thread 0) and returns when all have
//! finished it. Workers wait by spinning briefly, then sleep on a condition variable, so a
//! decode step of a few hundred small ops pays a few hundred nanoseconds per op, not a thread
//! spawn or a futex round trip.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Spins before sleeping: long enough to cover the gap between two ops of one forward pass.
const SPIN_ITERATIONS: usize = 1 << 12;

type Job = dyn Fn(usize) + Sync;

struct Shared {
    /// Incremented for every job; odd values are never used, so 0 means "none yet".
    generation: AtomicUsize,
    /// Workers that have finished the current job.
    done: AtomicUsize,
    /// The current job, valid while `run` waits for it (lifetime erased).
    job: Mutex<Option<JobPtr>>,
    wake: Condvar,
    shutdown: std::sync::atomic::AtomicBool,
}

#[derive(Clone, Copy)]
struct JobPtr(*const Job);
// SAFETY: the pointee is `Sync` and outlives every use (see `run`).
unsafe impl Send for JobPtr {}

pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl ThreadPool {
    pub fn new(threads: usize) -> ThreadPool {
        let shared = Arc::new(Shared {
            generation: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            job: Mutex::new(None),
            wake: Condvar::new(),
            shutdown: std::sync::atomic::AtomicBool::new(false),
        });
        // A process at its thread limit gets a smaller pool rather than a panic.
        let workers = (1..threads.max(1))
            .map_while(|index| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("axiom-cpu-{index}"))
                    .spawn(move || worker(&shared, index))
                    .inspect_err(|e| tracing::warn!("using {index} CPU threads: spawning another failed: {e}"))
                    .ok()
            })
            .collect();
        ThreadPool { shared, workers }
    }

    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `job(thread_index)` on every thread, the caller included, and waits for all.
    pub fn run(&self, job: &(dyn Fn(usize) + Sync)) {
        if self.workers.is_empty() {
            job(0);
            return;
        }
        // SAFETY (lifetime erasure): workers only call the job between the generation bump
        // below and their `done` increment, and this function does not return before every
        // worker has incremented `done`.
        let ptr: *const Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static Job>(job) };
        {
            let mut slot = self.shared.job.lock().unwrap_or_else(|p| p.into_inner());
            *slot = Some(JobPtr(ptr));
            self.shared.done.store(0, Ordering::Relaxed);
            self.shared.generation.fetch_add(2, Ordering::Release);
        }
        self.shared.wake.notify_all();
        job(0);
        let mut spins = 0usize;
        while self.shared.done.load(Ordering::Acquire) < self.workers.len() {
            spins += 1;
            if spins < SPIN_ITERATIONS {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

fn worker(shared: &Shared, index: usize) {
    let mut seen = 0usize;
    loop {
        // Wait for a new generation: spin first, then sleep.
        let mut spins = 0usize;
        loop {
            if shared.shutdown.load(Ordering::Acquire) {
                return;
            }
            let g = shared.generation.load(Ordering::Acquire);
            if g != seen {
                seen = g;
                break;
            }
            spins += 1;
            if spins < SPIN_ITERATIONS {
                std::hint::spin_loop();
            } else {
                let slot = shared.job.lock().unwrap_or_else(|p| p.into_inner());
                if shared.generation.load(Ordering::Acquire) == seen && !shared.shutdown.load(Ordering::Acquire) {
                    drop(shared.wake.wait(slot).unwrap_or_else(|p| p.into_inner()));
                }
                spins = 0;
            }
        }
        #[allow(clippy::expect_used, reason = "`run` sets the job before it starts a generation")]
        let job = shared
            .job
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .expect("a job is set with each generation");
        // SAFETY: see `ThreadPool::run`.
        unsafe { (*job.0)(index) };
        shared.done.fetch_add(1, Ordering::Release);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        {
            let _slot = self.shared.job.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.shutdown.store(true, Ordering::Release);
        }
        self.shared.wake.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// The part of `0..n` that thread `index` of `threads` takes, in multiples of `granule`.
pub fn split(n: usize, index: usize, threads: usize, granule: usize) -> std::ops::Range<usize> {
    let units = n.div_ceil(granule);
    let start = (units * index / threads * granule).min(n);
    let end = (units * (index + 1) / threads * granule).min(n);
    start..end
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_thread_runs_each_job_once() {
        let pool = ThreadPool::new(4);
        let counts: Vec<AtomicUsize> = (0..4).map(|_| AtomicUsize::new(0)).collect();
        for _ in 0..1000 {
            pool.run(&|i| {
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
        }
        assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1000));
    }

    #[test]
    fn split_covers_the_range_in_granules() {
        for (n, threads, granule) in [(37, 2, 4), (5, 8, 1), (1536, 2, 16), (0, 3, 8)] {
            let parts: Vec<_> = (0..threads).map(|i| split(n, i, threads, granule)).collect();
            assert_eq!(parts.first().unwrap().start, 0);
            assert_eq!(parts.last().unwrap().end, n);
            for w in parts.windows(2) {
                assert_eq!(w[0].end, w[1].start);
                assert!(w[0].end % granule == 0 || w[0].end == n);
            }
        }
    }
}
