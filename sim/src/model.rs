//! The simulated system: `H` onceq hosts draining one queue of payments
//! messages on Cloud Spanner, event by event.
//!
//! What is modelled, as onceq does it (docs/src/spanner.md):
//!
//! - **Leasing.** A host keeps up to `in_flight` messages going (16
//!   workers with four each). When it has room for at least `min_lease`
//!   it leases (its workers' requests coalesced: one lease at a time,
//!   at most `lease_batch`): a strong read of the queue's index from a
//!   random shard (one read round trip), candidates picked at random among
//!   the oldest four times as many as wanted (at most 192 more), then a
//!   read-write transaction that reads them by key (a round trip) and
//!   takes those still ready (the commit). A candidate another lease took
//!   first is lost; a round that lost some is followed by another, up to
//!   three. `pick_oldest` turns the random pick off (the lease before
//!   2026-12-03).
//! - **Handlers.** `workers` at a time per host, each a snapshot read (a
//!   round trip) and `handler_ms` of CPU.
//! - **Group commit.** One committer per host commits what has finished,
//!   up to `max_batch` messages, in one read-write transaction: it locks
//!   the accounts its messages debit and one of 64 counts rows (at its
//!   first read), re-reads for four round trips, and commits. Locks follow
//!   wound-wait, as Spanner's: an older transaction that wants a younger
//!   one's lock aborts it; a younger one waits. An aborted commit is re-run
//!   with its first attempt's age (the client passes the previous
//!   transaction id, so a retry keeps its priority).
//! - **The emulator** (`serial`): one read-write transaction at a time, in
//!   the order asked (onceq's turns: a lease or a batch waits for the turn
//!   and collects its work then), and every call (reads too) served one
//!   after another by one CPU-bound server: `read_ms` and `commit_ms` are
//!   then the server's time per call, not latencies.
//!
//! Not modelled: the outbox's own transactions (they are in the write
//! and read counts of the capacity model, not in the event flow), network
//! jitter, Spanner's own queueing as a node nears saturation (the capacity
//! model in `main.rs` keeps load under the recommended CPU), splits moving.

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap, VecDeque};

/// One simulated configuration.
#[derive(Debug, Clone)]
pub struct Params {
    pub hosts: usize,
    pub shards: usize,
    /// Messages a host has going at once (workers x 4).
    pub in_flight: usize,
    /// Handlers running at once per host.
    pub workers: usize,
    /// Most messages one lease takes.
    pub lease_batch: usize,
    /// A host leases once it has room for this many.
    pub min_lease: usize,
    /// `commit.max_batch`.
    pub max_batch: usize,
    /// Business rows (accounts) the messages debit, drawn by Zipf's law.
    pub accounts: usize,
    /// Zipf's exponent over the accounts (0: uniform).
    pub skew: f64,
    /// A read's round trip, ms.
    pub read_ms: f64,
    /// A commit's latency (replication), ms.
    pub commit_ms: f64,
    /// A handler's CPU, ms.
    pub handler_ms: f64,
    /// Simulated time, s (the first fifth is warm-up, not counted).
    pub seconds: f64,
    pub seed: u64,
    /// One read-write transaction at a time (the emulator).
    pub serial: bool,
    /// Leases take the oldest candidates, not a random pick among them.
    pub pick_oldest: bool,
    /// Rows of the processed counts per queue; each commit adds to one at
    /// random (`spanner_count_rows` in the host).
    pub count_rows: usize,
}

impl Default for Params {
    /// onceq's defaults on a regional instance.
    fn default() -> Self {
        Params {
            hosts: 1,
            shards: 8,
            in_flight: 64,
            workers: 16,
            lease_batch: 64,
            min_lease: 8,
            max_batch: 64,
            accounts: 100_000,
            skew: 0.0,
            read_ms: 2.0,
            commit_ms: 8.0,
            handler_ms: 0.05,
            seconds: 5.0,
            seed: 1,
            serial: false,
            pick_oldest: false,
            count_rows: 1_024,
        }
    }
}

/// What a run measured (after the warm-up).
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Messages committed per second.
    pub msgs_per_s: f64,
    /// Commit attempts aborted (wounded) per commit that landed.
    pub aborts_per_commit: f64,
    /// Messages per commit.
    pub batch: f64,
    /// Candidates lost to another lease, per candidate.
    pub candidates_lost: f64,
    /// Reads per message (lease reads, snapshots, the commit's re-reads).
    pub reads_per_msg: f64,
    /// Mean time from lease to commit, ms.
    pub latency_ms: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    LeaseStart { host: usize, round: u8 },
    LeaseLock { tx: usize },
    LeaseCommit { tx: usize },
    HandlerDone { host: usize, msg: usize },
    CommitStart { host: usize },
    CommitLock { tx: usize, epoch: u32 },
    CommitEnd { tx: usize, epoch: u32 },
}

/// Who holds the emulator's turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Turn {
    Lease(usize),
    Commit(usize),
}

impl Turn {
    fn host(self) -> usize {
        match self {
            Turn::Lease(h) | Turn::Commit(h) => h,
        }
    }
}

/// How often a host waiting for the emulator's turn polls the lock file
/// another process holds (`POLL` in the host's `turns.rs`), ms.
const TURN_POLL_MS: f64 = 2.0;

#[derive(Debug, Clone)]
struct Msg {
    account: usize,
    leased_at: u64,
}

#[derive(Debug, Default)]
struct Host {
    in_flight: usize,
    leasing: bool,
    handlers: usize,
    waiting: VecDeque<usize>,
    finished: Vec<usize>,
    committing: bool,
}

#[derive(Debug)]
enum Work {
    Lease {
        cands: Vec<(usize, u64)>,
        took: Vec<(usize, u64)>,
        round: u8,
    },
    Commit {
        msgs: Vec<usize>,
        locks: Vec<usize>,
        held: usize,
    },
}

#[derive(Debug)]
struct Tx {
    host: usize,
    /// The first attempt's start: the priority (older wins).
    age: u64,
    epoch: u32,
    work: Work,
}

/// Time in µs.
fn us(ms: f64) -> u64 {
    (ms * 1000.0).round().max(0.0) as u64
}

struct Sim {
    p: Params,
    rng: StdRng,
    now: u64,
    seq: u64,
    events: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    hosts: Vec<Host>,
    /// Ready message ids per shard, oldest first.
    ready: Vec<BTreeSet<u64>>,
    next_id: u64,
    msgs: Vec<Msg>,
    txs: Vec<Tx>,
    /// Lock holders by row (accounts, then the 64 counts rows).
    locks: HashMap<usize, usize>,
    /// Transactions waiting for a row's lock.
    waiters: HashMap<usize, Vec<usize>>,
    zipf: Vec<f64>,
    /// The emulator's one read-write transaction at a time, as onceq
    /// takes it: a host's lease or commit waits for the turn first and
    /// collects its work then (a batch formed when the turn came holds
    /// what finished meanwhile). The holder, and the waiting starts.
    turn: Option<Turn>,
    turn_queue: VecDeque<Ev>,
    /// The emulator's server: when it is next free.
    server_free: u64,
    counted_from: u64,
    stats: Counts,
}

#[derive(Default)]
struct Counts {
    committed: u64,
    commits: u64,
    aborts: u64,
    candidates: u64,
    candidates_lost: u64,
    reads: u64,
    latency_us: u64,
}

/// How many rows a shard keeps ready (the backlog never runs out).
const BACKLOG: usize = 2_048;
/// Read round trips a commit spends before it commits (a read per table
/// read, the leases, the dedup keys, the clock and counts).
const COMMIT_READS: u64 = 4;

impl Sim {
    fn new(p: Params) -> Sim {
        let mut rng = StdRng::seed_from_u64(p.seed);
        let mut zipf = Vec::with_capacity(p.accounts.max(1));
        let mut sum = 0.0;
        for k in 1..=p.accounts.max(1) {
            sum += 1.0 / (k as f64).powf(p.skew);
            zipf.push(sum);
        }
        for z in &mut zipf {
            *z /= sum;
        }
        let mut ready = vec![BTreeSet::new(); p.shards.max(1)];
        let mut next_id = 0;
        for _ in 0..BACKLOG * ready.len() {
            let shard = rng.random_range(0..ready.len());
            ready[shard].insert(next_id);
            next_id += 1;
        }
        let hosts = (0..p.hosts).map(|_| Host::default()).collect();
        let counted_from = us(p.seconds * 1000.0 / 5.0);
        Sim {
            p,
            rng,
            now: 0,
            seq: 0,
            events: BinaryHeap::new(),
            hosts,
            ready,
            next_id,
            msgs: Vec::new(),
            txs: Vec::new(),
            locks: HashMap::new(),
            waiters: HashMap::new(),
            zipf,
            turn: None,
            turn_queue: VecDeque::new(),
            server_free: 0,
            counted_from,
            stats: Counts::default(),
        }
    }

    fn at(&mut self, dt: u64, ev: Ev) {
        self.seq += 1;
        self.events.push(Reverse((self.now + dt, self.seq, ev)));
    }

    fn counting(&self) -> bool {
        self.now >= self.counted_from
    }

    fn account(&mut self) -> usize {
        let u: f64 = self.rng.random();
        self.zipf.partition_point(|&c| c < u).min(self.zipf.len() - 1)
    }

    /// A read's and a commit's time, µs.
    fn costs(&self) -> (u64, u64) {
        (us(self.p.read_ms), us(self.p.commit_ms))
    }

    /// When a database call of `cost` that starts `after` from now ends,
    /// from now. On Spanner calls run side by side (their latency); the
    /// emulator is one CPU-bound server, calls in the order they come.
    fn db(&mut self, after: u64, cost: u64) -> u64 {
        if !self.p.serial {
            return after + cost;
        }
        let start = self.server_free.max(self.now + after);
        self.server_free = start + cost;
        self.server_free - self.now
    }

    /// Whether `who` may go on (always, but on the emulator); if not,
    /// `ev` runs again when the turn comes.
    fn take_turn(&mut self, who: Turn, ev: Ev) -> bool {
        if !self.p.serial {
            return true;
        }
        match self.turn {
            Some(holder) if holder == who => true,
            None => {
                self.turn = Some(who);
                true
            }
            Some(_) => {
                self.turn_queue.push_back(ev);
                false
            }
        }
    }

    fn end_turn(&mut self, who: Turn) {
        if self.turn == Some(who) {
            self.turn = None;
            if let Some(ev) = self.turn_queue.pop_front() {
                let next = match ev {
                    Ev::LeaseStart { host, .. } => Turn::Lease(host),
                    Ev::CommitStart { host } => Turn::Commit(host),
                    _ => return self.at(0, ev), // only starts wait for the turn
                };
                self.turn = Some(next);
                // Within a process the turn passes at once (a semaphore);
                // to another process through the lock file, which a
                // waiting process polls every 0-2 ms (`turns.rs`).
                let handoff = if next.host() == who.host() {
                    0
                } else {
                    self.rng.random_range(0..us(TURN_POLL_MS))
                };
                self.at(handoff, ev);
            }
        }
    }

    fn run(mut self) -> Outcome {
        for host in 0..self.p.hosts {
            // Hosts start a little apart.
            let dt = self.rng.random_range(0..us(self.p.commit_ms).max(1));
            self.at(dt, Ev::LeaseStart { host, round: 0 });
        }
        let end = us(self.p.seconds * 1000.0);
        while let Some(Reverse((t, _, ev))) = self.events.pop() {
            if t > end {
                break;
            }
            self.now = t;
            self.step(ev);
        }
        let s = &self.stats;
        let secs = (end - self.counted_from) as f64 / 1e6;
        let per = |n: u64, d: u64| if d == 0 { 0.0 } else { n as f64 / d as f64 };
        Outcome {
            msgs_per_s: s.committed as f64 / secs,
            aborts_per_commit: per(s.aborts, s.commits),
            batch: per(s.committed, s.commits),
            candidates_lost: per(s.candidates_lost, s.candidates),
            reads_per_msg: per(s.reads, s.committed),
            latency_ms: per(s.latency_us, s.committed) / 1000.0,
        }
    }

    fn room(&self, host: usize) -> usize {
        self.p.in_flight.saturating_sub(self.hosts[host].in_flight)
    }

    fn maybe_lease(&mut self, host: usize) {
        if !self.hosts[host].leasing && self.room(host) >= self.p.min_lease.max(1) {
            self.hosts[host].leasing = true;
            self.at(0, Ev::LeaseStart { host, round: 0 });
        }
    }

    fn step(&mut self, ev: Ev) {
        match ev {
            Ev::LeaseStart { host, round } => self.lease_start(host, round),
            Ev::LeaseLock { tx } => self.lease_lock(tx),
            Ev::LeaseCommit { tx } => self.lease_commit(tx),
            Ev::HandlerDone { host, msg } => {
                self.hosts[host].handlers -= 1;
                self.hosts[host].finished.push(msg);
                self.next_handler(host);
                if !self.hosts[host].committing {
                    self.hosts[host].committing = true;
                    self.at(0, Ev::CommitStart { host });
                }
            }
            Ev::CommitStart { host } => self.commit_start(host),
            Ev::CommitLock { tx, epoch } if self.txs[tx].epoch == epoch => self.commit_lock(tx),
            Ev::CommitEnd { tx, epoch } if self.txs[tx].epoch == epoch => self.commit_end(tx),
            Ev::CommitLock { .. } | Ev::CommitEnd { .. } => {} // an aborted attempt's
        }
    }

    fn lease_start(&mut self, host: usize, round: u8) {
        self.hosts[host].leasing = true;
        if !self.take_turn(Turn::Lease(host), Ev::LeaseStart { host, round }) {
            return;
        }
        let want = self.room(host).min(self.p.lease_batch);
        if want == 0 {
            self.hosts[host].leasing = false;
            self.end_turn(Turn::Lease(host));
            return;
        }
        let window = (want * 4).min(want + 192);
        let first = self.rng.random_range(0..self.ready.len());
        let mut cands = Vec::with_capacity(window);
        for i in 0..self.ready.len() {
            let shard = (first + i) % self.ready.len();
            for &id in self.ready[shard].iter().take(window - cands.len()) {
                cands.push((shard, id));
            }
            if cands.len() >= window {
                break;
            }
        }
        if !self.p.pick_oldest {
            use rand::seq::SliceRandom;
            cands.shuffle(&mut self.rng);
        }
        cands.truncate(want);
        if self.counting() {
            self.stats.reads += 1;
        }
        let tx = self.txs.len();
        self.txs.push(Tx {
            host,
            age: self.now,
            epoch: 0,
            work: Work::Lease {
                cands,
                took: Vec::new(),
                round,
            },
        });
        // The candidates' read, then the read-write transaction's read.
        let (read, _) = self.costs();
        let dt = self.db(0, read);
        let dt = self.db(dt, read);
        self.at(dt, Ev::LeaseLock { tx });
    }

    fn lease_lock(&mut self, tx: usize) {
        let Work::Lease { cands, took, .. } = &mut self.txs[tx].work else {
            return;
        };
        for &(shard, id) in cands.iter() {
            if self.ready[shard].remove(&id) {
                took.push((shard, id));
            }
        }
        if self.counting() {
            self.stats.reads += 1;
        }
        let (_, commit) = self.costs();
        let dt = self.db(0, commit);
        self.at(dt, Ev::LeaseCommit { tx });
    }

    fn lease_commit(&mut self, tx: usize) {
        let host = self.txs[tx].host;
        let Work::Lease { cands, took, round } = std::mem::replace(
            &mut self.txs[tx].work,
            Work::Lease {
                cands: Vec::new(),
                took: Vec::new(),
                round: 0,
            },
        ) else {
            return;
        };
        let lost = cands.len() - took.len();
        // The backlog never runs out: new messages join the shards.
        for _ in 0..took.len() {
            let s = self.rng.random_range(0..self.ready.len());
            self.ready[s].insert(self.next_id);
            self.next_id += 1;
        }
        if self.counting() {
            self.stats.candidates += cands.len() as u64;
            self.stats.candidates_lost += lost as u64;
        }
        for _ in &took {
            let account = self.account();
            self.msgs.push(Msg {
                account,
                leased_at: self.now,
            });
            let msg = self.msgs.len() - 1;
            self.hosts[host].waiting.push_back(msg);
        }
        self.hosts[host].in_flight += took.len();
        self.next_handler(host);
        if lost > 0 && round < 2 && self.room(host) > 0 {
            self.at(0, Ev::LeaseStart { host, round: round + 1 });
            return;
        }
        self.end_turn(Turn::Lease(host));
        self.hosts[host].leasing = false;
        self.maybe_lease(host);
    }

    fn next_handler(&mut self, host: usize) {
        while self.hosts[host].handlers < self.p.workers {
            let Some(msg) = self.hosts[host].waiting.pop_front() else { break };
            self.hosts[host].handlers += 1;
            if self.counting() {
                self.stats.reads += 1;
            }
            let (read, _) = self.costs();
            let dt = self.db(0, read) + us(self.p.handler_ms);
            self.at(dt, Ev::HandlerDone { host, msg });
        }
    }

    fn commit_start(&mut self, host: usize) {
        if !self.take_turn(Turn::Commit(host), Ev::CommitStart { host }) {
            return;
        }
        let n = self.hosts[host].finished.len().min(self.p.max_batch.max(1));
        if n == 0 {
            self.hosts[host].committing = false;
            self.end_turn(Turn::Commit(host));
            return;
        }
        let msgs: Vec<usize> = self.hosts[host].finished.drain(..n).collect();
        let mut locks: Vec<usize> = msgs.iter().map(|&m| self.msgs[m].account).collect();
        locks.push(self.p.accounts + self.rng.random_range(0..self.p.count_rows.max(1)));
        locks.sort_unstable();
        locks.dedup();
        let tx = self.txs.len();
        self.txs.push(Tx {
            host,
            age: self.now,
            epoch: 0,
            work: Work::Commit { msgs, locks, held: 0 },
        });
        let (read, _) = self.costs();
        let dt = self.db(0, read);
        self.at(dt, Ev::CommitLock { tx, epoch: 0 });
    }

    /// Take the commit's locks in order (wound-wait); once all are held,
    /// the rest of its reads and the commit.
    fn commit_lock(&mut self, tx: usize) {
        loop {
            let (row, age) = match &self.txs[tx].work {
                Work::Commit { locks, held, .. } if *held < locks.len() => (locks[*held], self.txs[tx].age),
                _ => break,
            };
            match self.locks.get(&row).copied() {
                None => {}
                Some(holder) if holder == tx => {}
                Some(holder) if self.txs[holder].age > age => self.abort(holder),
                Some(_) => {
                    self.waiters.entry(row).or_default().push(tx);
                    return;
                }
            }
            self.locks.insert(row, tx);
            if let Work::Commit { held, .. } = &mut self.txs[tx].work {
                *held += 1;
            }
        }
        let epoch = self.txs[tx].epoch;
        let (read, commit) = self.costs();
        let mut dt = 0;
        for _ in 1..COMMIT_READS {
            dt = self.db(dt, read);
        }
        let dt = self.db(dt, commit);
        self.at(dt, Ev::CommitEnd { tx, epoch });
    }

    fn release(&mut self, tx: usize) {
        let rows: Vec<usize> = match &mut self.txs[tx].work {
            Work::Commit { locks, held, .. } => {
                let rows = locks[..*held].to_vec();
                *held = 0;
                rows
            }
            Work::Lease { .. } => Vec::new(),
        };
        for row in rows {
            if self.locks.get(&row) == Some(&tx) {
                self.locks.remove(&row);
            }
            if let Some(ws) = self.waiters.remove(&row) {
                for w in ws {
                    let epoch = self.txs[w].epoch;
                    self.at(0, Ev::CommitLock { tx: w, epoch });
                }
            }
        }
    }

    /// Wound `tx`: it releases its locks and re-runs (keeping its age)
    /// after a short pause.
    fn abort(&mut self, tx: usize) {
        self.release(tx);
        for ws in self.waiters.values_mut() {
            ws.retain(|&w| w != tx);
        }
        self.txs[tx].epoch += 1;
        if self.counting() {
            self.stats.aborts += 1;
        }
        let epoch = self.txs[tx].epoch;
        let pause = self.rng.random_range(us(0.5)..us(2.0));
        let (read, _) = self.costs();
        let dt = self.db(pause, read);
        self.at(dt, Ev::CommitLock { tx, epoch });
    }

    fn commit_end(&mut self, tx: usize) {
        self.release(tx);
        let host = self.txs[tx].host;
        self.end_turn(Turn::Commit(host));
        let msgs = match &mut self.txs[tx].work {
            Work::Commit { msgs, .. } => std::mem::take(msgs),
            Work::Lease { .. } => Vec::new(),
        };
        if self.counting() {
            self.stats.commits += 1;
            self.stats.committed += msgs.len() as u64;
            self.stats.reads += COMMIT_READS;
            for &m in &msgs {
                self.stats.latency_us += self.now - self.msgs[m].leased_at;
            }
        }
        self.hosts[host].in_flight -= msgs.len();
        self.hosts[host].committing = false;
        if !self.hosts[host].finished.is_empty() {
            self.hosts[host].committing = true;
            self.at(0, Ev::CommitStart { host });
        }
        self.maybe_lease(host);
    }
}

/// Run one configuration.
pub fn simulate(p: &Params) -> Outcome {
    Sim::new(p.clone()).run()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    /// One host, nothing shared: its pace is at most its messages in
    /// flight over a message's time from lease to commit (Little's law,
    /// with the room it leases into once there is room for 8), and a
    /// slower commit slows it in proportion to the longer round trip.
    #[test]
    fn one_host_is_paced_by_its_messages_in_flight_over_their_round_trips() {
        let o = simulate(&Params::default());
        let little = 64.0 / (o.latency_ms / 1000.0);
        assert!(o.msgs_per_s <= little && o.msgs_per_s > 0.5 * little, "{o:?} vs {little}");
        assert_eq!(o.aborts_per_commit, 0.0, "{o:?}");
        let slow = simulate(&Params {
            commit_ms: 16.0,
            ..Params::default()
        });
        assert!(
            slow.latency_ms > o.latency_ms + 10.0 && slow.msgs_per_s < 0.8 * o.msgs_per_s,
            "{o:?} {slow:?}"
        );
    }

    #[test]
    fn the_same_seed_gives_the_same_run() {
        let p = Params {
            hosts: 4,
            skew: 1.0,
            accounts: 100,
            ..Params::default()
        };
        let (a, b) = (simulate(&p), simulate(&p));
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
    }

    /// Hot rows: 10 hosts debiting 20 accounts wait for each other's
    /// locks (every batch holds them all), a fraction of the pace over
    /// 100,000 accounts; a skewed draw over many accounts aborts commits.
    #[test]
    fn hot_rows_cap_the_pace_and_skew_aborts_commits() {
        let p = |accounts, skew| Params {
            hosts: 10,
            shards: 32,
            accounts,
            skew,
            seconds: 2.0,
            ..Params::default()
        };
        let (hot, cold, skewed) = (simulate(&p(20, 0.0)), simulate(&p(100_000, 0.0)), simulate(&p(100_000, 1.0)));
        assert!(hot.msgs_per_s < 0.5 * cold.msgs_per_s, "{hot:?} {cold:?}");
        assert!(
            skewed.aborts_per_commit > 10.0 * cold.aborts_per_commit.max(0.01),
            "{skewed:?} {cold:?}"
        );
    }

    /// Taking the oldest candidates, hosts on few shards lose rounds to
    /// each other; a random pick among four times as many loses fewer.
    #[test]
    fn a_random_pick_loses_fewer_candidates_than_the_oldest() {
        let p = |pick_oldest| Params {
            hosts: 16,
            shards: 2,
            seconds: 2.0,
            pick_oldest,
            ..Params::default()
        };
        let (oldest, random) = (simulate(&p(true)), simulate(&p(false)));
        assert!(oldest.candidates_lost > 2.0 * random.candidates_lost, "{oldest:?} {random:?}");
    }

    /// The emulator's one transaction at a time: more hosts add nothing.
    #[test]
    fn on_the_emulator_hosts_take_turns() {
        let p = |hosts| Params {
            hosts,
            serial: true,
            seconds: 3.0,
            ..Params::default()
        };
        let (one, three) = (simulate(&p(1)), simulate(&p(3)));
        assert!(three.msgs_per_s < 1.3 * one.msgs_per_s, "{one:?} {three:?}");
    }
}
