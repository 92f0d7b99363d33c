//! The search over layouts: for every (data, pipeline) shape, a dynamic program over
//! (blocks placed, groups of equally fast hosts used, counted per class of alike groups)
//! that keeps the Pareto front of partial pipelines, the exhaustive search it is tested
//! against, and [`plan`], which ranks the best layout of every shape (the planner's "Search"
//! section). Costs come from the parent's model.

use super::{predict, HostLayout, HostSpec, Plan, PlanError, PlanInput, PlanReport, StageLayout};

/// Groups past this many per shape are not searched (the DP's states grow with the product
/// of its classes' sizes, 2^groups when every group differs).
pub const MAX_GROUPS: usize = 12;

/// A speed-sorted run of `d` hosts that holds one stage's replicas.
#[derive(Clone, Debug)]
struct Group {
    hosts: Vec<String>,
    speed: f64,
    mem: u64,
}

fn groups(hosts: &[HostSpec], d: usize) -> Vec<Group> {
    let mut sorted: Vec<&HostSpec> = hosts.iter().collect();
    sorted.sort_by(|a, b| {
        b.speed.total_cmp(&a.speed).then(b.mem_bytes.cmp(&a.mem_bytes)).then(a.name.cmp(&b.name))
    });
    sorted
        .chunks_exact(d)
        .take(MAX_GROUPS)
        .map(|c| Group {
            hosts: c.iter().map(|h| h.name.clone()).collect(),
            speed: c.iter().map(|h| h.speed).fold(f64::INFINITY, f64::min),
            mem: c.iter().map(|h| h.mem_bytes).min().unwrap_or(0),
        })
        .collect()
}

/// A Pareto point of the DP: a partial pipeline and its cost coordinates.
#[derive(Clone)]
struct Partial {
    sum: f64,
    max: f64,
    tail: f64,
    /// (end block, group) per stage so far.
    path: Vec<(usize, usize)>,
}

impl Partial {
    fn dominated_by(&self, o: &Partial) -> bool {
        o.sum <= self.sum && o.max <= self.max && o.tail <= self.tail
    }
}

fn push_pareto(front: &mut Vec<Partial>, cand: Partial) {
    if front.iter().any(|f| cand.dominated_by(f)) {
        return;
    }
    front.retain(|f| !f.dominated_by(&cand));
    front.push(cand);
}

/// The layout a search path describes: per stage, its end block and its group.
fn layout_of(gs: &[Group], d: usize, n: usize, path: &[(usize, usize)]) -> HostLayout {
    let mut start = 0;
    let stages = path
        .iter()
        .map(|&(end, g)| {
            let st = StageLayout { start, end, hosts: gs[g].hosts.clone() };
            start = end;
            st
        })
        .collect();
    HostLayout { data: d, micro_batch: n, stages }
}

fn build_plan(input: &PlanInput, gs: &[Group], d: usize, n: usize, path: &[(usize, usize)]) -> Plan {
    predict(input, &layout_of(gs, d, n, path)).expect("the search builds valid layouts")
}

/// The best layout with `d` replicas and `p` stages, by dynamic programming (once per
/// micro-batch choice).
fn best_for_shape(input: &PlanInput, d: usize, p: usize) -> Option<Plan> {
    let gs = groups(&input.hosts, d);
    if p > gs.len() || p > input.profile.blocks.len() || d > input.global_batch {
        return None;
    }
    input
        .micro_choices(d)
        .into_iter()
        .filter_map(|nm| best_for_micro(input, &gs, d, p, nm))
        .min_by(|a, b| a.step_ms.total_cmp(&b.step_ms))
}

/// Groups alike in speed and memory are interchangeable (a fleet of one instance type is
/// one class): the DP counts how many of each class a partial pipeline used, not which, so
/// its states are the product of (class size + 1) rather than 2^groups.
struct Classes {
    /// Each class's groups, in group order (a path's stages take them in that order).
    members: Vec<Vec<usize>>,
    speed: Vec<f64>,
    mem: Vec<u64>,
    /// A state's count of class c is `(state / stride[c]) % (members[c].len() + 1)`.
    stride: Vec<usize>,
    states: usize,
}

impl Classes {
    fn of(gs: &[Group]) -> Classes {
        let (mut members, mut speed, mut mem): (Vec<Vec<usize>>, Vec<f64>, Vec<u64>) = Default::default();
        for (g, group) in gs.iter().enumerate() {
            let same = (0..members.len())
                .find(|&c| speed[c].to_bits() == group.speed.to_bits() && mem[c] == group.mem);
            match same {
                Some(c) => members[c].push(g),
                None => {
                    members.push(vec![g]);
                    speed.push(group.speed);
                    mem.push(group.mem);
                }
            }
        }
        let mut stride = Vec::with_capacity(members.len());
        let mut states = 1;
        for m in &members {
            stride.push(states);
            states *= m.len() + 1;
        }
        Classes { members, speed, mem, stride, states }
    }

    fn used(&self, state: usize, c: usize) -> usize {
        (state / self.stride[c]) % (self.members[c].len() + 1)
    }

    /// Groups a state has used in all.
    fn total(&self, state: usize) -> usize {
        (0..self.members.len()).map(|c| self.used(state, c)).sum()
    }

    /// A path of (end block, class) stages as (end block, group): each class's groups taken
    /// in order.
    fn groups_of(&self, path: &[(usize, usize)]) -> Vec<(usize, usize)> {
        let mut next = vec![0; self.members.len()];
        path.iter()
            .map(|&(end, c)| {
                next[c] += 1;
                (end, self.members[c][next[c] - 1])
            })
            .collect()
    }
}

fn best_for_micro(
    input: &PlanInput,
    gs: &[Group],
    d: usize,
    p: usize,
    (n, m): (usize, usize),
) -> Option<Plan> {
    let nb = input.profile.blocks.len();
    let cl = Classes::of(gs);
    let by_total: Vec<Vec<usize>> = {
        let mut v = vec![Vec::new(); p];
        for state in 0..cl.states {
            let t = cl.total(state);
            if t < p {
                v[t].push(state);
            }
        }
        v
    };
    // front[i][state]: partial pipelines placing blocks 0..i on the groups a state counts;
    // each path's stages are (end block, class).
    let mut front: Vec<Vec<Vec<Partial>>> = vec![vec![Vec::new(); cl.states]; nb + 1];
    front[0][0].push(Partial { sum: 0.0, max: 0.0, tail: 0.0, path: Vec::new() });
    for i in 0..nb {
        let (done, ahead) = front.split_at_mut(i + 1);
        let here = &done[i];
        for (s, states) in by_total.iter().enumerate() {
            if states.iter().all(|&st| here[st].is_empty()) {
                continue;
            }
            // The last stage must take every remaining block; earlier ones leave at least one
            // block per remaining stage.
            let ends: Vec<usize> = if s + 1 == p { vec![nb] } else { (i + 1..=nb - (p - s - 1)).collect() };
            for c in 0..cl.members.len() {
                for &j in &ends {
                    // One stage's cost, whatever else the state holds.
                    let cost = input.stage_cost((i, j), s, p, d, (n, m), cl.speed[c]);
                    if cost.mem_bytes > cl.mem[c] {
                        continue;
                    }
                    for &state in states {
                        if cl.used(state, c) == cl.members[c].len() {
                            continue;
                        }
                        let into = &mut ahead[j - i - 1][state + cl.stride[c]];
                        for part in &here[state] {
                            let mut path = part.path.clone();
                            path.push((j, c));
                            push_pareto(
                                into,
                                Partial {
                                    sum: part.sum + cost.micro_ms,
                                    max: part.max.max(cost.micro_ms),
                                    tail: part.tail.max(cost.tail_ms),
                                    path,
                                },
                            );
                        }
                    }
                }
            }
        }
    }
    let mut best: Option<(f64, &Partial)> = None;
    for (state, parts) in front[nb].iter().enumerate() {
        if cl.total(state) != p {
            continue;
        }
        for part in parts {
            let t = part.sum + (m as f64 - 1.0) * part.max + part.tail;
            if best.is_none_or(|(bt, _)| t < bt) {
                best = Some((t, part));
            }
        }
    }
    best.map(|(_, part)| build_plan(input, gs, d, n, &cl.groups_of(&part.path)))
}

/// The best layout with `d` replicas and `p` stages by trying every cut and every ordered
/// choice of groups: the reference the DP is tested against. Exponential; small inputs only.
pub fn exhaustive(input: &PlanInput, d: usize, p: usize) -> Option<Plan> {
    let nb = input.profile.blocks.len();
    let gs = groups(&input.hosts, d);
    if p > gs.len() || p > nb || d > input.global_batch {
        return None;
    }
    let mut best: Option<Plan> = None;
    let mut cuts = Vec::new();
    let mut order = Vec::new();
    for (n, _) in input.micro_choices(d) {
        visit_cuts(nb, p, 0, &mut cuts, &mut |ends| {
            visit_orders(gs.len(), p, &mut order, &mut |groups_in_order| {
                let path: Vec<(usize, usize)> =
                    ends.iter().copied().zip(groups_in_order.iter().copied()).collect();
                if let Ok(plan) = predict(input, &layout_of(&gs, d, n, &path)) {
                    if best.as_ref().is_none_or(|b| plan.step_ms < b.step_ms) {
                        best = Some(plan);
                    }
                }
            });
        });
    }
    best
}

fn visit_cuts(nb: usize, p: usize, start: usize, ends: &mut Vec<usize>, f: &mut dyn FnMut(&[usize])) {
    if ends.len() + 1 == p {
        ends.push(nb);
        f(ends);
        ends.pop();
        return;
    }
    let left = p - ends.len() - 1;
    for e in start + 1..=nb - left {
        ends.push(e);
        visit_cuts(nb, p, e, ends, f);
        ends.pop();
    }
}

fn visit_orders(k: usize, p: usize, order: &mut Vec<usize>, f: &mut dyn FnMut(&[usize])) {
    if order.len() == p {
        f(order);
        return;
    }
    for g in 0..k {
        if !order.contains(&g) {
            order.push(g);
            visit_orders(k, p, order, f);
            order.pop();
        }
    }
}

/// Plans the fastest layout for the input: the best of every (data, pipeline) shape.
pub fn plan(input: &PlanInput) -> Result<PlanReport, PlanError> {
    input.validate()?;
    let nb = input.profile.blocks.len();
    let h = input.hosts.len();
    let max_p = input.max_depth.unwrap_or(nb).min(nb).max(1);
    let mut plans = Vec::new();
    for d in 1..=h {
        for p in 1..=max_p.min(h / d) {
            if let Some(plan) = best_for_shape(input, d, p) {
                plans.push(plan);
            }
        }
    }
    // Fastest first; among equal predictions prefer more replicas (more state survives a
    // loss), then fewer stages (less traffic that the model does not capture).
    plans.sort_by(|a, b| {
        a.step_ms
            .total_cmp(&b.step_ms)
            .then(b.layout.data.cmp(&a.layout.data))
            .then(a.layout.pipeline().cmp(&b.layout.pipeline()))
    });
    if plans.is_empty() {
        let need = input.stage_memory_floor();
        let most = input.hosts.iter().map(|h| h.mem_bytes).max().unwrap_or(0);
        return Err(PlanError::NoFit(format!(
            "even the largest block alone needs {need} bytes (weights, gradients, optimizer state and one sample's activations), and the largest host has {most}; deeper pipelines keep more activations"
        )));
    }
    let best = plans.remove(0);
    let reason = match plans.first() {
        Some(next) => format!(
            "{}x{} predicts {:.2} ms per step, {:.1}% faster than the next shape ({}x{}, {:.2} ms)",
            best.layout.data,
            best.layout.pipeline(),
            best.step_ms,
            (next.step_ms - best.step_ms) / next.step_ms * 100.0,
            next.layout.data,
            next.layout.pipeline(),
            next.step_ms
        ),
        None => format!(
            "{}x{} is the only shape that fits ({:.2} ms per step)",
            best.layout.data,
            best.layout.pipeline(),
            best.step_ms
        ),
    };
    Ok(PlanReport { best, runners_up: plans, reason })
}

impl PlanInput {
    /// The least memory any layout needs on some host: the largest block alone, with
    /// micro-batches of one sample.
    fn stage_memory_floor(&self) -> u64 {
        let per_sample = |v: u64| v.div_ceil(self.profile.micro_batch as u64);
        self.profile
            .blocks
            .iter()
            .map(|b| 2 * b.param_bytes + b.optim_bytes + per_sample(b.saved_bytes))
            .max()
            .unwrap_or(0)
    }
}
