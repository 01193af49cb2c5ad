//! The MPI backend's point-to-point messages, sub-communicators and a
//! duplicate used from a second thread under a real `mpirun -np 4`
//! (feature `mpi`; CI installs OpenMPI).
//!
//! Run by `cargo test`, this binary starts `mpirun` on itself; started by
//! `mpirun` (the launcher announces a rank), it is one rank of the job and
//! runs the scenario the environment names.

use comm::launcher::launcher_rank;
use comm::{CommError, Communicator};
use comm_mpi::MpiComm;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// Which scenario the ranks run.
const MODE: &str = "MACROBATCH_COMM_MPI_MODE";

fn main() {
    match launcher_rank() {
        Some(_) => rank_main(),
        None => launch_all(),
    }
}

fn mpirun(mode: &str) -> Output {
    let exe = std::env::current_exe().expect("the test knows its own path");
    Command::new("mpirun")
        .args(["-np", "4"])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .env("OMPI_MCA_btl", "self,vader")
        .env(MODE, mode)
        .arg(exe)
        .output()
        .expect("mpirun runs (apt-get install openmpi-bin)")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Runs `mode` and checks that the job succeeded with every rank printing `rank R: {what}`.
fn every_rank_says(mode: &str, what: &str) {
    let o = mpirun(mode);
    let all = text(&o);
    assert!(o.status.success(), "{all}");
    for r in 0..4 {
        assert!(all.contains(&format!("rank {r}: {what}")), "rank {r} did not finish: {all}");
    }
}

fn launch_all() {
    every_rank_says("messages", "ok");
    println!("mpi -np 4: ring exchange, split 2×2 with key order, length mismatch: ok");
    every_rank_says("threads", "two threads ok");
    println!("mpi -np 4: a duplicate's all-reduces on a second thread beside the world's: ok");

    let t0 = Instant::now();
    let o = mpirun("abort");
    let all = text(&o);
    assert!(!o.status.success(), "an abort in a sub-communicator must end the job: {all}");
    assert!(all.contains("rank 1 (world rank 3) failed: injected"), "{all}");
    assert!(t0.elapsed() < Duration::from_secs(20), "took {:?}: {all}", t0.elapsed());
    println!("mpi -np 4: an abort in a sub-communicator ends the job: ok");

    let t0 = Instant::now();
    let o = mpirun("stall");
    let all = text(&o);
    assert!(!o.status.success(), "{all}");
    assert!(t0.elapsed() < Duration::from_secs(15), "the abort must end the job: took {:?}", t0.elapsed());
    assert!(all.contains("rank 0 waited 1.0s in recv for a message from rank 1 under tag 8"), "{all}");
    println!("mpi -np 4: a receive from a stalled rank names it after the timeout: ok");
}

fn rank_main() {
    let mode = std::env::var(MODE).unwrap_or_default();
    let timeout = if mode == "stall" { Duration::from_secs(1) } else { Duration::from_secs(30) };
    let init = if mode == "threads" { MpiComm::init_threaded } else { MpiComm::init };
    let mut c = init(timeout).expect("MPI starts");
    assert_eq!(c.world_size(), 4);
    let me = c.rank();
    match mode.as_str() {
        "messages" => {
            messages(&mut c).expect("no communication error");
            // Funneled: no communicator for another thread.
            assert!(matches!(c.duplicate(), Err(CommError::Unsupported(_))));
            println!("rank {me}: ok");
        }
        "threads" => {
            // MPI_THREAD_MULTIPLE: the duplicate's all-reduces on a second
            // thread run while the world's run on this one; each sum is exact
            // (small integers) and lands on its own communicator.
            let mut dup = c.duplicate().expect("a duplicate under MPI_THREAD_MULTIPLE");
            let sum = |i: usize, base: f32| 4.0 * (base + i as f32) + 6.0; // Σ over ranks 0..4 of base + i + rank
            std::thread::scope(|s| {
                let other = s.spawn(|| {
                    for i in 0..50 {
                        let mut b = vec![1000.0 + i as f32 + me as f32; 4096];
                        dup.all_reduce_sum(&mut b).expect("the duplicate's all-reduce");
                        assert!(b.iter().all(|&x| x == sum(i, 1000.0)), "duplicate, round {i}: {}", b[0]);
                    }
                });
                for i in 0..50 {
                    let mut b = vec![i as f32 + me as f32; 4096];
                    c.all_reduce_sum(&mut b).expect("the world's all-reduce");
                    assert!(b.iter().all(|&x| x == sum(i, 0.0)), "world, round {i}: {}", b[0]);
                }
                other.join().expect("the second thread");
            });
            drop(dup); // before the world's handle finalises MPI
            println!("rank {me}: two threads ok");
        }
        "abort" => {
            let mut sub = c.split(me / 2, me).expect("split");
            if me == 3 {
                sub.abort("injected");
            }
            // The others wait in a collective that rank 3 never joins.
            let _ = c.barrier();
            std::thread::sleep(Duration::from_secs(30));
        }
        "stall" => {
            // Only rank 0 waits (for rank 1, which never sends); the others idle until the abort.
            if me == 0 {
                let _ = c.recv(&mut [0.0], 1, 8);
            }
            std::thread::sleep(Duration::from_secs(20));
        }
        other => panic!("unknown {MODE}={other:?}"),
    }
}

fn messages(c: &mut MpiComm) -> Result<(), CommError> {
    let me = c.rank();
    let (right, left) = ((me + 1) % 4, (me + 3) % 4);
    // Ring in both directions, every send before any receive; the big
    // messages go beyond the eager limit, so blocking sends would deadlock.
    let big: Vec<f32> = (0..1 << 20).map(|i| (me * 7 + i) as f32).collect();
    for i in 0..3 {
        c.send(&[me as f32, i as f32], right, 1)?;
    }
    c.send(&big, right, 2)?;
    c.send(&big, left, 2)?;
    c.send(&[me as f32 + 0.5], left, 3)?;
    let mut got3 = [0.0];
    c.recv(&mut got3, right, 3)?;
    assert_eq!(got3, [right as f32 + 0.5]);
    for i in 0..3 {
        let mut m = [0.0; 2];
        c.recv(&mut m, left, 1)?;
        assert_eq!(m, [left as f32, i as f32], "messages under one tag arrive in order");
    }
    let mut from = vec![0.0f32; big.len()];
    for src in [left, right] {
        c.recv(&mut from, src, 2)?;
        assert!(from.iter().enumerate().all(|(i, &x)| x == (src * 7 + i) as f32), "payload from {src}");
    }
    c.flush_sends()?;
    let counted = c.counters();
    assert_eq!((counted.p2p_messages, counted.p2p_bytes_sent), (6, 4 * (3 * 2 + 2 * (1 << 20) + 1)));
    assert_eq!(counted.n_calls, 0, "sends are not collectives");

    // Length mismatch: reported with both lengths, and the next message still arrives.
    if me == 0 {
        c.send(&[1.0, 2.0, 3.0], 1, 5)?;
        c.send(&[4.0, 5.0], 1, 5)?;
    } else if me == 1 {
        let mut two = [0.0; 2];
        let e = c.recv(&mut two, 0, 5).unwrap_err();
        assert!(e.to_string().contains("rank 0 sent 3 elements under tag 5 but the receive buffer holds 2"), "{e}");
        c.recv(&mut two, 0, 5)?;
        assert_eq!(two, [4.0, 5.0]);
    }

    // Split 2×2: colors {0, 2} and {1, 3}, keys reversing the order.
    let mut sub = c.split(me % 2, 10 - me)?;
    assert_eq!((sub.world_size(), sub.rank()), (2, 1 - me / 2));
    let mut a = [me as f32];
    sub.all_reduce_sum(&mut a)?;
    assert_eq!(a, [(2 + 2 * (me % 2)) as f32], "a sub-group sums its members only");
    let peer = 1 - sub.rank();
    sub.send(&[me as f32], peer, 0)?;
    let mut p = [0.0];
    sub.recv(&mut p, peer, 0)?;
    assert_eq!(p, [((me + 2) % 4) as f32], "sub-group ranks address the other member");
    sub.flush_sends()?;
    drop(sub);
    // MPI is still up after the sub-communicator is gone.
    let mut s = [1.0];
    c.all_reduce_sum(&mut s)?;
    assert_eq!(s, [4.0]);
    c.barrier()
}
