//! The read-ahead store against a fake object whose GETs run on threads of
//! their own: bytes and order, errors, the bound on parts held.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;

use super::readahead::{Parts, ReadAhead};
use super::{Kind, RemoteError};

struct Fake {
    store: Arc<ReadAhead>,
    id: u64,
    data: Bytes,
    /// Parts whose GET fails once (then succeeds) or comes back short.
    fail: Mutex<Vec<u64>>,
    short: Option<u64>,
    fetched: Mutex<Vec<u64>>,
    in_flight: Arc<AtomicUsize>,
    peak_in_flight: Arc<AtomicUsize>,
}

impl Fake {
    fn new(store: &Arc<ReadAhead>, len: usize) -> Arc<Fake> {
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
        Arc::new(Fake {
            store: store.clone(),
            id: store.new_id(),
            data: Bytes::from(data),
            fail: Mutex::new(Vec::new()),
            short: None,
            fetched: Mutex::new(Vec::new()),
            in_flight: Arc::default(),
            peak_in_flight: Arc::default(),
        })
    }

    fn fetched(&self) -> Vec<u64> {
        self.fetched.lock().unwrap().clone()
    }

    fn read(&self, buf: &mut [u8], offset: u64, sequential: bool) -> super::Result<()> {
        self.store.read(self, buf, offset, sequential)
    }
}

impl Parts for Fake {
    fn id(&self) -> u64 {
        self.id
    }
    fn size(&self) -> u64 {
        self.data.len() as u64
    }
    fn url(&self) -> String {
        "s3://b/fake".into()
    }
    fn fetch(&self, index: u64, start: u64, len: u64) {
        self.fetched.lock().unwrap().push(index);
        let fail = {
            let mut f = self.fail.lock().unwrap();
            let hit = f.contains(&index);
            f.retain(|&i| i != index);
            hit
        };
        let mut got = Ok(self.data.slice(start as usize..(start + len) as usize));
        if fail {
            got = Err(RemoteError {
                kind: Kind::Unreachable,
                url: self.url(),
                detail: "connection reset".into(),
            });
        } else if self.short == Some(index) {
            got = Ok(self.data.slice(start as usize..(start + len / 2) as usize));
        }
        let (store, id) = (self.store.clone(), self.id);
        let (n, peak) = (self.in_flight.clone(), self.peak_in_flight.clone());
        let now = n.fetch_add(1, Ordering::SeqCst) + 1;
        peak.fetch_max(now, Ordering::SeqCst);
        std::thread::spawn(move || {
            // later parts come back first: order is the store's job
            std::thread::sleep(Duration::from_millis(20 - (index % 4) * 5));
            n.fetch_sub(1, Ordering::SeqCst);
            store.done(id, index, got);
        });
    }
}

/// Reads the whole object front to back in `step`-byte reads.
fn read_all(f: &Fake, step: usize) -> super::Result<Vec<u8>> {
    let mut out = vec![0u8; f.data.len()];
    let mut at = 0;
    while at < out.len() {
        let n = step.min(out.len() - at);
        f.read(&mut out[at..at + n], at as u64, true)?;
        at += n;
    }
    Ok(out)
}

#[test]
fn a_sequential_reader_gets_every_byte_each_part_fetched_once() {
    for step in [1usize, 333, 1000, 1001, 4096, 100_000] {
        let store = Arc::new(ReadAhead::new(4, 1000));
        let f = Fake::new(&store, 10_500);
        assert_eq!(read_all(&f, step).unwrap(), f.data, "step {step}");
        let mut fetched = f.fetched();
        let n = fetched.len();
        fetched.sort_unstable();
        fetched.dedup();
        assert_eq!(fetched, (0..11).collect::<Vec<_>>(), "step {step}");
        assert_eq!(n, 11, "a part fetched twice at step {step}");
        assert_eq!(store.held(), 0, "parts read in full stay held");
    }
}

#[test]
fn parts_are_fetched_ahead_in_order_and_in_parallel() {
    let store = Arc::new(ReadAhead::new(8, 1000));
    let f = Fake::new(&store, 20_000);
    assert_eq!(read_all(&f, 1000).unwrap(), f.data);
    let fetched = f.fetched();
    assert!(fetched.windows(2).all(|w| w[0] < w[1]), "{fetched:?}");
    assert!(f.peak_in_flight.load(Ordering::SeqCst) > 4, "no read-ahead");
}

#[test]
fn a_read_elsewhere_fetches_only_its_own_parts() {
    let store = Arc::new(ReadAhead::new(8, 1000));
    let f = Fake::new(&store, 20_000);
    let mut buf = vec![0u8; 1500];
    f.read(&mut buf, 5_200, false).unwrap();
    assert_eq!(buf, f.data[5_200..6_700]);
    assert_eq!(f.fetched(), vec![5, 6]);
}

#[test]
fn a_small_read_is_served_from_its_part() {
    let store = Arc::new(ReadAhead::new(8, 1000));
    let f = Fake::new(&store, 5_000);
    let mut buf = [0u8; 8];
    f.read(&mut buf, 3_010, false).unwrap();
    f.read(&mut buf, 3_500, false).unwrap();
    assert_eq!(buf[..], f.data[3_500..3_508]);
    assert_eq!(f.fetched(), vec![3]);
}

#[test]
fn a_failed_get_surfaces_and_a_later_read_fetches_again() {
    let store = Arc::new(ReadAhead::new(4, 1000));
    let f = Fake::new(&store, 10_000);
    f.fail.lock().unwrap().push(3);
    let err = read_all(&f, 700).unwrap_err();
    assert_eq!(err.kind, Kind::Unreachable);
    assert_eq!(err.url, "s3://b/fake");
    let mut buf = vec![0u8; 1000];
    f.read(&mut buf, 3_000, false).unwrap();
    assert_eq!(buf, f.data[3_000..4_000]);
}

#[test]
fn a_short_get_is_an_error_not_short_bytes() {
    let store = Arc::new(ReadAhead::new(4, 1000));
    let mut f = Fake::new(&store, 10_000);
    Arc::get_mut(&mut f).unwrap().short = Some(2);
    let err = read_all(&f, 1000).unwrap_err();
    assert_eq!(err.kind, Kind::Other);
    assert!(err.detail.contains("got 500 bytes"), "{}", err.detail);
}

#[test]
fn parts_held_stay_within_the_limit_for_any_object_size() {
    for len in [10_000usize, 100_000, 400_000] {
        let store = Arc::new(ReadAhead::new(6, 1000));
        let f = Fake::new(&store, len);
        assert_eq!(read_all(&f, 1000).unwrap(), f.data);
        // 2 x 6 held; a read of one part's length spans at most two: those come on top
        assert!(store.peak() <= 12 + 2, "peak {} at {len}", store.peak());
        assert!(f.peak_in_flight.load(Ordering::SeqCst) <= 6 + 2);
    }
}

#[test]
fn readers_of_two_halves_share_the_limit_and_get_their_bytes() {
    let store = Arc::new(ReadAhead::new(8, 1000));
    let f = Fake::new(&store, 64_000);
    let halves: Vec<Vec<u8>> = std::thread::scope(|s| {
        let readers: Vec<_> = [0usize, 32_000]
            .into_iter()
            .map(|from| {
                let f = &f;
                s.spawn(move || {
                    let mut out = vec![0u8; 32_000];
                    for at in (0..32_000).step_by(4_000) {
                        f.read(&mut out[at..at + 4_000], (from + at) as u64, true)
                            .unwrap();
                    }
                    out
                })
            })
            .collect();
        readers.into_iter().map(|r| r.join().unwrap()).collect()
    });
    assert_eq!(halves.concat(), f.data);
    // each reader's own read (4 parts, 5 where unaligned) may come on top
    assert!(store.peak() <= 16 + 2 * 5, "peak {}", store.peak());
    assert_eq!(store.held(), 0);
}

#[test]
fn a_closed_object_leaves_nothing_held() {
    let store = Arc::new(ReadAhead::new(8, 1000));
    let f = Fake::new(&store, 20_000);
    let mut buf = vec![0u8; 100];
    f.read(&mut buf, 0, true).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(store.held() > 0);
    store.forget(f.id);
    assert_eq!(store.held(), 0);
}
