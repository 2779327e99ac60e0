//! The placement engine: one policy over one cluster, with per-node values cached by node version.
//!
//! A decision evaluates every node, but a node whose version has not changed since the last time the
//! same request shape was evaluated is not recomputed: after a placement only the chosen node is.
//! A shape is the GPU part of a request (slots, device IDs and models); requests of one shape that differ in host
//! CPU or memory share a node's value where the policy says they may ([`Policy::cpu_band`]), so users
//! picking exact CPU requests do not multiply the work. The cache holds at most [`MAX_ENTRIES`] node
//! values; past that the least recently used shapes are forgotten.
//! Randomness comes only from the `Rng` the caller passes; remaining ties go to the caller's node order.

use crate::load::Load;
use crate::model::{Cluster, Grant, ModelError, ModelId, NodeId};
use crate::policy::{Context, Eval, Policy, Ties};
use crate::request::{FrontEnd, Reason, Request, SlotDemand, host_check};
use crate::rng::Rng;
use crate::workload::Workload;
use std::collections::{BTreeMap, HashMap};
use std::fmt;

/// Node values the cache may hold (120 bytes each, plus 32 per grant): 100 shapes at 5,000 nodes.
pub const MAX_ENTRIES: usize = 1 << 19;

/// Rank of each node for breaking ties: lower rank wins.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeOrder(pub Vec<u32>);

impl NodeOrder {
    /// Node `i` has rank `i`.
    pub fn identity(n: usize) -> Self {
        NodeOrder((0..n as u32).collect())
    }

    /// A seeded random permutation, as the paper's per-seed node name prefixes.
    pub fn shuffled(n: usize, rng: &mut Rng) -> Self {
        let mut perm: Vec<u32> = (0..n as u32).collect();
        rng.shuffle(&mut perm);
        let mut rank = vec![0; n];
        for (r, &node) in perm.iter().enumerate() {
            rank[node as usize] = r as u32;
        }
        NodeOrder(rank)
    }

    /// A fixed pseudo-random order derived from node names and a salt, stable across restarts and
    /// replicas (what a live allocator uses, since it has no seed shared with anyone).
    pub fn hashed<'a>(names: impl IntoIterator<Item = &'a str>, salt: u64) -> Self {
        let keys: Vec<u64> = names.into_iter().map(|n| name_hash(n, salt)).collect();
        let mut idx: Vec<usize> = (0..keys.len()).collect();
        idx.sort_by_key(|&i| (keys[i], i));
        let mut rank = vec![0; keys.len()];
        for (r, &i) in idx.iter().enumerate() {
            rank[i] = r as u32;
        }
        NodeOrder(rank)
    }

    /// The rank of a node (nodes added after the order was made come last).
    pub fn rank(&self, node: NodeId) -> u32 {
        self.0.get(node.0).copied().unwrap_or(u32::MAX)
    }
}

/// FNV-1a over the name, then mixed with the salt.
pub fn name_hash(name: &str, salt: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ salt;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    Rng::new(h).next_u64()
}

/// The node a request goes to and what it gets there.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// Chosen node.
    pub node: NodeId,
    /// Its value and card grants.
    pub eval: Eval,
}

/// No node fits: how many nodes failed for each kind of reason.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Unschedulable {
    /// Nodes considered.
    pub nodes: usize,
    /// Reason kind → number of nodes.
    pub reasons: BTreeMap<String, usize>,
}

impl fmt::Display for Unschedulable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "0/{} nodes are available", self.nodes)?;
        for (i, (reason, n)) in self.reasons.iter().enumerate() {
            write!(f, "{} {n} {reason}", if i == 0 { ":" } else { "," })?;
        }
        Ok(())
    }
}

/// A node's value for one shape, and what it was computed for.
struct Cached {
    /// The node's version.
    version: u64,
    /// The last request's host CPU and memory (the value is exactly theirs).
    cpu: u64,
    mem: u64,
    /// Its [`Policy::cpu_band`] and [`host_check`] outcome: requests with the same share the value.
    band: u64,
    host: Option<Reason>,
    result: Result<Eval, Reason>,
}

/// The GPU part of a request: what a cache entry is keyed by. (The device IDs follow from the
/// slots for nearly every pod; they are in the key for the few whose init containers make them
/// differ.)
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Shape {
    slots: Vec<SlotDemand>,
    ids: u64,
    models: Option<Vec<ModelId>>,
    front_end: FrontEnd,
}

impl Shape {
    fn of(req: &Request) -> Self {
        Shape { slots: req.slots.clone(), ids: req.ids, models: req.models.clone(), front_end: req.front_end }
    }
}

/// One shape's node values.
#[derive(Default)]
struct Slots {
    /// Which shape they are for; `None` while the slot is free.
    shape: Option<Shape>,
    /// Per node.
    values: Vec<Option<Cached>>,
    /// When a decision last used them.
    used: u64,
    /// Tells a [`Prepared`] made before the slot was reused from one made after.
    serial: u64,
}

/// A request looked up in the cache, ready to be evaluated on many nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prepared {
    slot: usize,
    serial: u64,
}

/// Cache hit and miss counts, to check that decisions are incremental.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Node values reused.
    pub hits: u64,
    /// Node values computed.
    pub misses: u64,
}

fn supply_of(cluster: &Cluster) -> (Vec<u32>, f64) {
    (cluster.supply().to_vec(), cluster.cpu_per_card())
}

/// A policy deciding over a cluster.
pub struct Engine {
    cluster: Cluster,
    policy: Box<dyn Policy>,
    ctx: Context,
    /// The model supply `ctx.pressure` was computed for, and the cluster's CPU per card.
    supply: (Vec<u32>, f64),
    shapes: HashMap<Shape, usize>,
    cache: Vec<Slots>,
    /// Node values held, over all shapes.
    entries: usize,
    /// Counts lookups, for least-recently-used eviction and for [`Prepared`] serials.
    clock: u64,
    /// Cache counters.
    pub stats: CacheStats,
    /// Real utilisation per card, the last tie rule ([`Load`]); none: the policy's ties alone.
    load: Option<Load>,
}

impl Engine {
    /// An engine for `cluster` under `policy` with target workload `workload`.
    pub fn new(cluster: Cluster, policy: Box<dyn Policy>, workload: Workload) -> Self {
        let supply = supply_of(&cluster);
        let ctx = Context::new(workload, &supply.0, supply.1);
        Engine {
            cluster,
            policy,
            ctx,
            supply,
            shapes: HashMap::new(),
            cache: Vec::new(),
            entries: 0,
            clock: 0,
            stats: CacheStats::default(),
            load: None,
        }
    }

    /// The reading of real utilisation that breaks the policy's ties from now on (`None`: none
    /// does; placement is exactly the policy's). Cached values stay valid: load is never part of one.
    pub fn set_load(&mut self, load: Option<Load>) {
        self.load = load;
    }

    /// The reading in use, if any.
    pub fn load(&self) -> Option<&Load> {
        self.load.as_ref()
    }

    /// How busy the cards `grants` take on `node` are ([`Load::of_grants`]); `None` without a
    /// reading of all of them.
    pub fn busy(&self, node: NodeId, grants: &[Grant]) -> Option<f64> {
        self.load.as_ref()?.of_grants(self.cluster.node(node), grants)
    }

    /// The cluster as it is now.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// Changes the cluster (nodes added, cards marked unhealthy, …). Changed nodes get new versions,
    /// so cached values stay correct.
    pub fn cluster_mut(&mut self) -> &mut Cluster {
        &mut self.cluster
    }

    /// The policy.
    pub fn policy(&self) -> &dyn Policy {
        self.policy.as_ref()
    }

    /// The target workload.
    pub fn workload(&self) -> &Workload {
        &self.ctx.workload
    }

    /// Replaces the target workload; cached values that depend on it are dropped.
    pub fn set_workload(&mut self, workload: Workload) {
        if workload != self.ctx.workload {
            self.ctx = Context::new(workload, &self.supply.0, self.supply.1);
            self.context_changed();
        }
    }

    fn context_changed(&mut self) {
        if self.policy.uses_workload() {
            self.cache.clear();
            self.shapes.clear();
            self.entries = 0;
        }
    }

    /// Recomputes the model pressure and the CPU load when nodes brought new cards or CPU (a rare
    /// event: node add/remove).
    fn refresh_supply(&mut self) {
        if self.cluster.supply() != self.supply.0.as_slice() || self.cluster.cpu_per_card() != self.supply.1 {
            self.supply = supply_of(&self.cluster);
            let ctx = Context::new(self.ctx.workload.clone(), &self.supply.0, self.supply.1);
            if ctx != self.ctx {
                self.ctx = ctx;
                self.context_changed();
            }
        }
    }

    /// The cache slot of `req`'s shape, made (forgetting the least recently used shapes if the cache
    /// is full) if it has none.
    fn shape(&mut self, req: &Request) -> Prepared {
        self.clock += 1;
        let key = Shape::of(req);
        if let Some(&slot) = self.shapes.get(&key) {
            let s = &mut self.cache[slot];
            s.used = self.clock;
            return Prepared { slot, serial: s.serial };
        }
        let nodes = self.cluster.nodes().len();
        while self.entries + nodes > MAX_ENTRIES {
            let Some(oldest) = (0..self.cache.len())
                .filter(|&i| self.cache[i].shape.is_some())
                .min_by_key(|&i| self.cache[i].used)
            else {
                break;
            };
            let s = &mut self.cache[oldest];
            if let Some(shape) = s.shape.take() {
                self.shapes.remove(&shape);
            }
            self.entries -= s.values.len();
            s.values = Vec::new();
        }
        let slot = match self.cache.iter().position(|s| s.shape.is_none()) {
            Some(free) => free,
            None => {
                self.cache.push(Slots::default());
                self.cache.len() - 1
            }
        };
        self.shapes.insert(key.clone(), slot);
        // Made full size now, so that what the loop above made room for is what it takes.
        let mut values = Vec::new();
        values.resize_with(nodes, || None);
        self.entries += nodes;
        self.cache[slot] = Slots { shape: Some(key), values, used: self.clock, serial: self.clock };
        Prepared { slot, serial: self.clock }
    }

    /// Shapes whose node values the cache holds, and those values (for tests).
    pub fn cache_size(&self) -> (usize, usize) {
        (self.shapes.len(), self.entries)
    }

    /// The policy's value of `req` on `node`, computed only if the node changed since last asked.
    pub fn evaluate(&mut self, req: &Request, node: NodeId) -> &Result<Eval, Reason> {
        let prepared = self.prepare(req);
        self.evaluate_prepared(prepared, req, node)
    }

    /// Looks `req` up once before evaluating it on many nodes with [`Engine::evaluate_prepared`].
    pub fn prepare(&mut self, req: &Request) -> Prepared {
        self.refresh_supply();
        self.shape(req)
    }

    /// [`Engine::evaluate`] for a request [`Engine::prepare`]d before (the same `req`; if the cache
    /// forgot its shape since, it is looked up again).
    pub fn evaluate_prepared(
        &mut self,
        prepared: Prepared,
        req: &Request,
        node: NodeId,
    ) -> &Result<Eval, Reason> {
        let slot =
            self.cache.get(prepared.slot).filter(|s| s.serial == prepared.serial).map(|_| prepared.slot);
        let slot = match slot {
            Some(slot) => slot,
            None => self.shape(req).slot,
        };
        self.evaluate_shape(slot, req, node)
    }

    fn evaluate_shape(&mut self, slot: usize, req: &Request, node: NodeId) -> &Result<Eval, Reason> {
        let n = self.cluster.node(node);
        let (policy, ctx) = (self.policy.as_ref(), &self.ctx);
        let values = &mut self.cache[slot].values;
        // Nodes added since the shape was made (a rare event) grow it.
        if values.len() <= node.0 {
            let len = self.cluster.nodes().len().max(node.0 + 1);
            self.entries += len - values.len();
            values.resize_with(len, || None);
        }
        let value = &mut values[node.0];
        let hit = match value {
            // The same request again is the common case: no band to compute.
            Some(c) if c.version == n.version && (c.cpu, c.mem) == (req.cpu, req.mem) => true,
            _ => {
                let (band, host) = (policy.cpu_band(n, req.cpu, ctx), host_check(n, req).err());
                match value {
                    Some(c) if c.version == n.version && c.band == band && c.host == host => {
                        if let Ok(eval) = &mut c.result
                            && c.cpu != req.cpu
                        {
                            policy.refine(n, req, eval, ctx);
                        }
                        (c.cpu, c.mem) = (req.cpu, req.mem);
                        true
                    }
                    _ => {
                        let result = policy.evaluate(n, req, ctx);
                        *value = Some(Cached {
                            version: n.version,
                            cpu: req.cpu,
                            mem: req.mem,
                            band,
                            host,
                            result,
                        });
                        false
                    }
                }
            }
        };
        if hit {
            self.stats.hits += 1;
        } else {
            self.stats.misses += 1;
        }
        match value {
            Some(c) => &c.result,
            None => unreachable!("filled above"),
        }
    }

    /// The best node among `candidates` (all nodes if `None`): highest score, then tiebreak, then
    /// the less busy chosen cards (with a [`Load`] reading of all of them), then the policy's tie
    /// rule (node order, or uniform with `rng`).
    pub fn decide(
        &mut self,
        req: &Request,
        candidates: Option<&[NodeId]>,
        order: &NodeOrder,
        rng: &mut Rng,
    ) -> Result<Decision, Unschedulable> {
        self.refresh_supply();
        let shape = self.shape(req).slot;
        let all: Vec<NodeId>;
        let candidates = match candidates {
            Some(c) => c,
            None => {
                all = (0..self.cluster.nodes().len()).map(NodeId).collect();
                &all
            }
        };
        let uniform = self.policy.ties() == Ties::Uniform;
        // The best so far: node, score, tiebreak, rank, load of its chosen cards.
        type Best = (NodeId, f64, [f64; 2], u32, Option<f64>);
        let mut best: Option<Best> = None;
        let mut equal = 0usize;
        let mut failed = Unschedulable { nodes: candidates.len(), reasons: BTreeMap::new() };
        let reading = self.load.is_some();
        for &node in candidates {
            let (score, tiebreak, grants) = match self.evaluate_shape(shape, req, node) {
                Err(reason) => {
                    *failed.reasons.entry(reason.kind().to_owned()).or_default() += 1;
                    continue;
                }
                Ok(eval) => (eval.score, eval.tiebreak, reading.then(|| eval.grants.clone())),
            };
            let busy = grants.and_then(|g| self.busy(node, &g));
            let rank = order.rank(node);
            let better = match best {
                None => true,
                Some((_, s, t, r, b)) => {
                    if score != s {
                        score > s
                    } else if tiebreak != t {
                        tiebreak > t
                    } else if let (Some(here), Some(there)) = (busy, b)
                        && here != there
                    {
                        here < there
                    } else if uniform {
                        // Reservoir sampling over the equal best, as kube-scheduler's selectHost.
                        equal += 1;
                        rng.below(equal) == 0
                    } else {
                        rank < r
                    }
                }
            };
            if better {
                let apart = |b: Option<f64>| matches!((busy, b), (Some(x), Some(y)) if x != y);
                let tied = best.is_some_and(|(_, s, t, _, b)| s == score && t == tiebreak && !apart(b));
                if !tied {
                    equal = 1;
                }
                best = Some((node, score, tiebreak, rank, busy));
            }
        }
        let Some((node, ..)) = best else {
            return Err(failed);
        };
        let eval = match self.evaluate_shape(shape, req, node) {
            Ok(e) => e.clone(),
            Err(_) => unreachable!("the best node fits"),
        };
        Ok(Decision { node, eval })
    }

    /// Takes the resources of a decision.
    pub fn commit(&mut self, req: &Request, node: NodeId, grants: &[Grant]) -> Result<(), ModelError> {
        self.cluster.apply(node, req.host(), grants)
    }

    /// Gives back what [`Engine::commit`] took.
    pub fn release(&mut self, req: &Request, node: NodeId, grants: &[Grant]) {
        self.cluster.release(node, req.host(), grants);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Card, ModelId, Node};
    use crate::policy;
    use crate::request::SlotDemand;
    use nano_gpu_proto::units::{MiB, Percent};

    fn cluster(n: usize) -> Cluster {
        let mut c = Cluster::new();
        let m = c.models.intern("T4");
        for i in 0..n {
            let cards = (0..2).map(|g| Card::new(format!("n{i}-g{g}"), g, m, MiB(15_360))).collect();
            c.add_node(Node::new(format!("n{i}"), 16_000, 65_536, cards)).unwrap();
        }
        c
    }

    fn share(p: u32) -> Request {
        Request::new(1000, 1024, vec![SlotDemand::Share { percent: Some(Percent(p)), mem: None }])
    }

    #[test]
    fn load_breaks_only_what_the_policy_leaves_equal() {
        let reading = |busy: &[(&str, f64)]| {
            Load::new(busy.iter().map(|&(u, l)| (u.to_owned(), l)).collect::<HashMap<_, _>>())
        };
        for name in ["fgd-balance", "fgd", "binpack", "spread", "bestfit"] {
            let mut e = Engine::new(cluster(3), policy::by_name(name, 0).unwrap(), Workload::default());
            let order = NodeOrder::identity(3);
            let req = share(50);
            let plain = e.decide(&req, None, &order, &mut Rng::new(1)).unwrap();
            // The nodes are equal: the one whose chosen cards are less busy wins, not the first.
            let all = [
                ("n0-g0", 90.0),
                ("n0-g1", 90.0),
                ("n1-g0", 5.0),
                ("n1-g1", 5.0),
                ("n2-g0", 50.0),
                ("n2-g1", 50.0),
            ];
            e.set_load(Some(reading(&all)));
            let d = e.decide(&req, None, &order, &mut Rng::new(1)).unwrap();
            assert_eq!((plain.node, d.node), (NodeId(0), NodeId(1)), "{name}");
            assert_eq!(d.eval.score, plain.eval.score, "{name}: the value is the policy's");
            // A card without a reading compares with nothing: the node order decides again.
            e.set_load(Some(reading(&all[2..])));
            assert_eq!(e.decide(&req, None, &order, &mut Rng::new(1)).unwrap().node, NodeId(0), "{name}");
            e.set_load(None);
            assert_eq!(e.decide(&req, None, &order, &mut Rng::new(1)).unwrap(), plain, "{name}");
        }
        // Load never beats the policy's value: with n1 half full, binpack takes n1 however busy.
        let mut e = Engine::new(cluster(2), policy::by_name("binpack", 0).unwrap(), Workload::default());
        let req = share(50);
        e.commit(&req, NodeId(1), &[Grant { slot: 0, card: 0, percent: Percent(50), mem: MiB(7680) }])
            .unwrap();
        e.set_load(Some(reading(&[("n0-g0", 0.0), ("n0-g1", 0.0), ("n1-g0", 100.0), ("n1-g1", 100.0)])));
        assert_eq!(e.decide(&req, None, &NodeOrder::identity(2), &mut Rng::new(1)).unwrap().node, NodeId(1));
    }

    #[test]
    fn after_a_placement_only_the_chosen_node_is_recomputed() {
        let mut e = Engine::new(cluster(50), policy::by_name("binpack", 0).unwrap(), Workload::default());
        let order = NodeOrder::identity(50);
        let mut rng = Rng::new(1);
        let req = share(30);
        let d = e.decide(&req, None, &order, &mut rng).unwrap();
        e.commit(&req, d.node, &d.eval.grants).unwrap();
        assert_eq!(e.stats.misses, 50);
        e.decide(&req, None, &order, &mut rng).unwrap();
        assert_eq!(e.stats.misses, 51);
        assert_eq!(e.stats.hits, 49 + 1 + 1);
    }

    #[test]
    fn requests_differing_only_in_cpu_share_fgds_values() {
        let reqs: Vec<Request> = (0..20).map(|i| Request { cpu: 1000 + i, ..share(30) }).collect();
        let workload = Workload::from_requests(&reqs);
        let mut e = Engine::new(cluster(50), policy::by_name("fgd-balance", 0).unwrap(), workload);
        let (order, mut rng) = (NodeOrder::identity(50), Rng::new(1));
        for req in &reqs {
            e.decide(req, None, &order, &mut rng).unwrap();
        }
        // Every node left 14,000 or more CPU: all in the same band, evaluated once.
        assert_eq!(e.stats.misses, 50);
        assert_eq!(e.cache_size(), (1, 50));
        // binpack's score follows the exact CPU: nothing shared.
        let mut e = Engine::new(cluster(50), policy::by_name("binpack", 0).unwrap(), Workload::default());
        for req in &reqs {
            e.decide(req, None, &order, &mut rng).unwrap();
        }
        assert_eq!(e.stats.misses, 20 * 50);
    }

    #[test]
    fn the_cache_forgets_the_least_recently_used_shapes_past_its_entries() {
        let nodes = 4096;
        let fit = MAX_ENTRIES / nodes;
        let mut e = Engine::new(cluster(nodes), policy::by_name("binpack", 0).unwrap(), Workload::default());
        let (order, mut rng) = (NodeOrder::identity(nodes), Rng::new(1));
        // One shape per card memory asked.
        let shape = |mib: u32| {
            Request::new(
                1000,
                1024,
                vec![SlotDemand::Share { percent: Some(Percent(1)), mem: Some(MiB(u64::from(mib))) }],
            )
        };
        // Shapes 1..=fit+10 %, then shape 1 again (recently used), then one more.
        for p in (1..=fit as u32 + 10).chain([1, 99]) {
            e.decide(&shape(p), None, &order, &mut rng).unwrap();
            assert!(e.cache_size().1 <= MAX_ENTRIES, "{:?}", e.cache_size());
        }
        assert_eq!(e.cache_size(), (fit, fit * nodes));
        // Shape 1 was kept (used again), the oldest of the others forgotten.
        let misses = e.stats.misses;
        e.decide(&shape(1), None, &order, &mut rng).unwrap();
        assert_eq!(e.stats.misses, misses);
        let prepared = e.prepare(&shape(2));
        assert!(e.evaluate_prepared(prepared, &shape(2), NodeId(0)).is_ok());
        assert_eq!(e.stats.misses, misses + 1);
        // A request prepared before its shape was forgotten is looked up again.
        let stale = e.prepare(&shape(3));
        for p in 20..20 + fit as u32 {
            e.prepare(&shape(p));
            e.evaluate(&shape(p), NodeId(0));
        }
        assert!(e.evaluate_prepared(stale, &shape(3), NodeId(0)).is_ok());
        assert!(e.cache_size().1 <= MAX_ENTRIES, "{:?}", e.cache_size());
    }

    #[test]
    fn ties_go_to_the_first_node_in_the_order() {
        let mut e = Engine::new(cluster(5), policy::by_name("binpack", 0).unwrap(), Workload::default());
        let order = NodeOrder(vec![3, 1, 4, 0, 2]);
        let d = e.decide(&share(30), None, &order, &mut Rng::new(1)).unwrap();
        assert_eq!(d.node, NodeId(3));
    }

    #[test]
    fn uniform_ties_spread_over_the_equal_nodes() {
        let mut e = Engine::new(cluster(4), policy::by_name("random", 0).unwrap(), Workload::default());
        let order = NodeOrder::identity(4);
        let mut rng = Rng::new(9);
        let mut seen = [0; 4];
        for _ in 0..400 {
            seen[e.decide(&share(1), None, &order, &mut rng).unwrap().node.0] += 1;
        }
        assert!(seen.iter().all(|&n| (60..140).contains(&n)), "{seen:?}");
    }

    #[test]
    fn unschedulable_counts_reasons_per_node() {
        let mut c = cluster(3);
        c.add_node(Node::new("cpu-only", 64_000, 65_536, vec![])).unwrap();
        let mut e = Engine::new(c, policy::by_name("fgd", 0).unwrap(), Workload::default());
        let big = Request::new(1000, 0, vec![SlotDemand::Whole { cards: 4, mem: None }]);
        let err = e.decide(&big, None, &NodeOrder::identity(4), &mut Rng::new(1)).unwrap_err();
        assert_eq!(err.to_string(), "0/4 nodes are available: 3 larger than any card, 1 node has no GPU");
    }

    #[test]
    fn model_restrictions_steer_to_the_allowed_cards() {
        let mut c = cluster(2);
        let a100 = c.models.intern("A100");
        c.add_node(Node::new("big", 64_000, 65_536, vec![Card::new("a", 0, a100, MiB(81_920))])).unwrap();
        let mut e = Engine::new(c, policy::by_name("spread", 0).unwrap(), Workload::default());
        let mut req = share(10);
        req.models = Some(vec![ModelId(1)]);
        let d = e.decide(&req, None, &NodeOrder::identity(3), &mut Rng::new(1)).unwrap();
        assert_eq!(e.cluster().node(d.node).name, "big");
    }
}
