//! The thread backend's tests: collectives, failures, point-to-point and split.

use super::*;

fn run<T: Send>(world: usize, timeout: Duration, f: impl Fn(ThreadComm) -> T + Sync) -> Vec<std::thread::Result<T>> {
    let comms = group(world, timeout);
    std::thread::scope(|s| {
        let handles: Vec<_> = comms.into_iter().map(|c| s.spawn(|| f(c))).collect();
        handles.into_iter().map(|h| h.join()).collect()
    })
}

#[test]
fn collectives_compute_the_right_values() {
    let out = run(3, Duration::from_secs(10), |mut c| {
        let r = c.rank() as f32;
        let mut a = vec![r, 1.0];
        c.all_reduce_sum(&mut a).unwrap();
        let mut rs = vec![0.0; 2];
        c.reduce_scatter_sum(&[r, r, 1.0, 1.0, 2.0 * r, 0.0], &mut rs).unwrap();
        let mut ag = vec![0.0; 3];
        c.all_gather(&[r * 10.0], &mut ag).unwrap();
        let mut b = vec![r; 2];
        c.broadcast(&mut b, 2).unwrap();
        let mut d = vec![0.1f64 * c.rank() as f64];
        c.all_reduce_sum_f64(&mut d).unwrap();
        c.barrier().unwrap();
        (a, rs, ag, b, d, c.counters().n_calls)
    });
    for (rank, o) in out.into_iter().enumerate() {
        let (a, rs, ag, b, d, n) = o.unwrap();
        assert_eq!(a, vec![3.0, 3.0]);
        let want_rs = [vec![3.0, 3.0], vec![3.0, 3.0], vec![6.0, 0.0]][rank].clone();
        assert_eq!(rs, want_rs, "rank {rank}");
        assert_eq!(ag, vec![0.0, 10.0, 20.0]);
        assert_eq!(b, vec![2.0, 2.0]);
        assert!((d[0] - 0.3).abs() < 1e-15);
        assert_eq!(n, 6);
    }
}

#[test]
fn a_panicking_rank_is_named_and_nobody_hangs() {
    let t0 = Instant::now();
    let out = run(3, Duration::from_secs(30), |mut c| {
        if c.rank() == 1 {
            panic!("injected failure");
        }
        let mut a = vec![1.0];
        c.all_reduce_sum(&mut a)
    });
    assert!(t0.elapsed() < Duration::from_secs(5), "failure must be noticed without waiting for the timeout");
    assert!(out[1].is_err());
    for r in [0, 2] {
        let e = out[r].as_ref().unwrap().as_ref().unwrap_err();
        assert!(matches!(e, CommError::RankFailed { rank: 1, .. }), "{e}");
        assert!(e.to_string().contains("rank 1 failed (panicked)"), "{e}");
    }
}

#[test]
fn a_stalled_rank_is_named_after_the_timeout() {
    let t0 = Instant::now();
    let out = run(2, Duration::from_millis(300), |mut c| {
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_secs(2));
            return Ok(());
        }
        c.barrier()
    });
    let e = out[0].as_ref().unwrap().as_ref().unwrap_err().clone();
    assert!(matches!(e, CommError::Timeout { ref missing, .. } if missing == &vec![1]), "{e}");
    assert!(t0.elapsed() >= Duration::from_millis(300));
}

#[test]
fn mismatched_calls_are_errors() {
    let out = run(2, Duration::from_secs(5), |mut c| {
        let mut a = vec![0.0; 1 + c.rank()];
        c.all_reduce_sum(&mut a)
    });
    assert!(out.iter().any(|o| matches!(o, Ok(Err(CommError::Mismatch { .. })))));
    assert!(out.iter().all(|o| matches!(o, Ok(Err(_)))));
}

#[test]
fn messages_arrive_in_order_per_tag_and_crossed_sends_do_not_deadlock() {
    let out = run(2, Duration::from_secs(10), |mut c| {
        let (me, peer) = (c.rank(), 1 - c.rank());
        // Both ranks send everything before receiving anything.
        for i in 0..3 {
            c.send(&[me as f32, i as f32], peer, 7)?;
        }
        c.send(&[10.0 + me as f32], peer, 9)?;
        // The later tag first: tags are independent queues.
        let mut b9 = [0.0];
        c.recv(&mut b9, peer, 9)?;
        let mut got = Vec::new();
        for _ in 0..3 {
            let mut b = [0.0; 2];
            c.recv(&mut b, peer, 7)?;
            got.push(b);
        }
        // Ping-pong: rank 0 serves, rank 1 returns the value plus one.
        let mut x = [0.0f32];
        for _ in 0..20 {
            if me == 0 {
                c.send(&x, 1, 3)?;
                c.recv(&mut x, 1, 3)?;
            } else {
                c.recv(&mut x, 0, 3)?;
                x[0] += 1.0;
                c.send(&x, 0, 3)?;
            }
        }
        Ok::<_, CommError>((b9, got, x))
    });
    for (me, o) in out.into_iter().enumerate() {
        let (b9, got, x) = o.unwrap().unwrap();
        let peer = (1 - me) as f32;
        assert_eq!(b9, [10.0 + peer]);
        assert_eq!(got, vec![[peer, 0.0], [peer, 1.0], [peer, 2.0]], "rank {me}");
        assert_eq!(x, [20.0], "rank {me}");
    }
}

#[test]
fn a_receive_of_the_wrong_length_names_both_lengths() {
    let out = run(2, Duration::from_secs(10), |mut c| {
        if c.rank() == 0 {
            c.send(&[1.0, 2.0, 3.0], 1, 0)?;
            c.send(&[4.0, 5.0], 1, 0)?;
            return Ok(None);
        }
        let mut short = [0.0; 2];
        let e = c.recv(&mut short, 0, 0).unwrap_err();
        // The mismatched message is consumed; the next one is received.
        c.recv(&mut short, 0, 0)?;
        Ok::<_, CommError>(Some((e, short)))
    });
    let (e, next) = out[1].as_ref().unwrap().as_ref().unwrap().clone().unwrap();
    assert!(matches!(e, CommError::BadLength { op: "recv", .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("sent 3 elements") && msg.contains("holds 2"), "{msg}");
    assert_eq!(next, [4.0, 5.0]);
}

#[test]
fn a_departed_source_fails_a_receive_promptly() {
    let t0 = Instant::now();
    let out = run(2, Duration::from_secs(30), |mut c| {
        if c.rank() == 1 {
            // One message, then the rank leaves without the second.
            return c.send(&[5.0], 0, 1).map(|_| [0.0]);
        }
        let mut b = [0.0];
        c.recv(&mut b, 1, 1)?;
        assert_eq!(b, [5.0], "a message sent before leaving is still delivered");
        c.recv(&mut b, 1, 1).map(|_| b)
    });
    assert!(t0.elapsed() < Duration::from_secs(5), "took {:?}", t0.elapsed());
    let e = out[0].as_ref().unwrap().as_ref().unwrap_err();
    assert!(matches!(e, CommError::RankFailed { rank: 1, me: 0, .. }), "{e}");
    assert!(e.to_string().contains("left the group"), "{e}");
}

#[test]
fn a_stalled_source_is_named_after_the_timeout() {
    let out = run(2, Duration::from_millis(300), |mut c| {
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_secs(1));
            return Ok(());
        }
        c.recv(&mut [0.0], 1, 4)
    });
    let e = out[0].as_ref().unwrap().as_ref().unwrap_err();
    assert!(matches!(e, CommError::Timeout { op: "recv", missing, .. } if missing == &vec![1]), "{e}");
}

#[test]
fn receiving_from_itself_takes_its_own_messages_and_never_waits() {
    let mut c = group(1, Duration::from_secs(30)).pop().unwrap();
    c.send(&[1.0, 2.0], 0, 5).unwrap();
    let mut b = [0.0; 2];
    c.recv(&mut b, 0, 5).unwrap();
    assert_eq!(b, [1.0, 2.0]);
    let t0 = Instant::now();
    assert_eq!(c.recv(&mut b, 0, 5), Err(CommError::NothingToReceive { tag: 5, me: 0 }));
    assert!(t0.elapsed() < Duration::from_secs(1));
    assert!(matches!(c.send(&b, 1, 5), Err(CommError::BadLength { op: "send", .. })));
}

#[test]
fn sends_count_as_point_to_point_not_as_collectives() {
    let out = run(2, Duration::from_secs(10), |mut c| {
        let peer = 1 - c.rank();
        c.all_reduce_sum(&mut [1.0; 4])?;
        let before = c.counters();
        c.send(&[0.0; 5], peer, 0)?;
        c.send(&[0.0; 3], peer, 1)?;
        c.recv(&mut [0.0; 5], peer, 0)?;
        c.recv(&mut [0.0; 3], peer, 1)?;
        Ok::<_, CommError>((before, c.counters()))
    });
    for o in out {
        let (before, after) = o.unwrap().unwrap();
        assert_eq!((before.n_calls, before.bytes_sent, before.p2p_messages), (1, 16, 0));
        assert_eq!(after, CommCounters { p2p_messages: 2, p2p_bytes_sent: 32, ..before });
    }
}

#[test]
fn split_groups_reduce_over_their_members_only_ordered_by_key() {
    let out = run(4, Duration::from_secs(10), |mut c| {
        let me = c.rank();
        // Colors {0, 2} and {1, 3}; keys reverse the order within each.
        let mut sub = c.split(me % 2, 10 - me)?;
        let mut a = [me as f32];
        sub.all_reduce_sum(&mut a)?;
        // Point-to-point inside the sub-group uses its ranks.
        let peer = 1 - sub.rank();
        sub.send(&[100.0 + me as f32], peer, 0)?;
        let mut b = [0.0];
        sub.recv(&mut b, peer, 0)?;
        // A second split: the whole group under one color, ranked as here.
        let mut all = c.split(0, 0)?;
        let mut s = [1.0];
        all.all_reduce_sum(&mut s)?;
        Ok::<_, CommError>((sub.rank(), sub.world_size(), a, b, all.rank(), s))
    });
    let got: Vec<_> = out.into_iter().map(|o| o.unwrap().unwrap()).collect();
    assert_eq!(got[0], (1, 2, [2.0], [102.0], 0, [4.0]));
    assert_eq!(got[1], (1, 2, [4.0], [103.0], 1, [4.0]));
    assert_eq!(got[2], (0, 2, [2.0], [100.0], 2, [4.0]));
    assert_eq!(got[3], (0, 2, [4.0], [101.0], 3, [4.0]));
}

/// Rank 3 leaves after the split. Rank 2 waits for it in their sub-group's
/// all-reduce and rank 0 in a receive from it; rank 1 waits in a receive
/// from rank 0 of its sub-group, which stays alive after its error and so
/// can only be noticed through the failure shared by all groups.
#[test]
fn a_departed_rank_fails_sub_group_collectives_and_receives_promptly() {
    let out = run(4, Duration::from_secs(60), |mut c| {
        let me = c.rank();
        let mut sub = c.split(me / 2, 0)?;
        let t0 = Instant::now();
        let r = match me {
            3 => return Ok((Duration::ZERO, Ok(()))),
            2 => sub.all_reduce_sum(&mut [1.0]),
            0 => c.recv(&mut [0.0], 3, 0),
            _ => sub.recv(&mut [0.0], 0, 0),
        };
        let waited = t0.elapsed();
        if me == 0 {
            std::thread::sleep(Duration::from_secs(3));
        }
        Ok::<_, CommError>((waited, r))
    });
    for (me, o) in out.into_iter().enumerate().take(3) {
        let (waited, r) = o.unwrap().unwrap();
        let e = r.unwrap_err();
        assert!(waited < Duration::from_secs(2), "rank {me} waited {waited:?}: {e}");
        assert!(matches!(e, CommError::RankFailed { .. }), "rank {me}: {e}");
        assert!(e.to_string().contains("left the group"), "rank {me}: {e}");
    }
}

#[test]
fn an_abort_in_a_sub_group_stops_the_world() {
    let t0 = Instant::now();
    let out = run(4, Duration::from_secs(60), |mut c| {
        let me = c.rank();
        let mut sub = c.split(me / 2, 0)?;
        if me == 3 {
            sub.abort("injected");
            std::thread::sleep(Duration::from_secs(3));
            return Ok(());
        }
        c.barrier()
    });
    assert!(t0.elapsed() < Duration::from_secs(5), "took {:?}", t0.elapsed());
    for o in &out[..3] {
        let e = o.as_ref().unwrap().as_ref().unwrap_err();
        assert!(matches!(e, CommError::RankFailed { rank: 3, .. }), "{e}");
        assert!(e.to_string().contains("injected"), "{e}");
    }
}
