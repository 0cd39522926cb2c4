//! Property tests of the scheduler on random workloads: random prompts and limits, random step
//! choices (fixed steps changing between iterations, or the adaptive policy), random accepted
//! counts, random EOS, random aborts and stop strings (also while a plan is in flight, and in the
//! report, keeping a random prefix of the emitted tokens), and small pools that force preemption,
//! and plans abandoned after a failed step.
//!
//! Rows: every plan's rows are unique and in range, equal `row_of`, and a request keeps its row
//! from the prefill chunk at position 0 until it finishes or is preempted (checked against the
//! rows the test saw); `check_invariants` checks that held and free rows partition the range.
//!
//! The fake model emits the token `tok(id, position)`, a pure function of the request and the
//! position, whatever the drafts and however often the request was preempted; so every request
//! that finishes must have exactly the output computed here from its limits alone.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;
use specdial_core::scheduler::{FinishReason, Finished, Plan, PlanKind, RequestState};
use specdial_core::{
    AdaptiveConfig, AdaptiveSpeculativeParams, ReportExtras, Scheduler, SchedulerConfig,
    StepsSource,
};

const EOS: i64 = 0;

/// The fake model's token at `pos` of request `id`: EOS about once in 40 positions.
fn tok(id: u64, pos: u64) -> i64 {
    let x = (id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ pos.wrapping_mul(0xD1B5_4A32_D192_ED03))
        .rotate_left(17);
    (x % 40) as i64
}

#[derive(Debug, Clone)]
struct Req {
    prompt_len: u64,
    max_new: i64,
    stop: Vec<i64>,
    ignore_eos: bool,
}

#[derive(Debug, Clone)]
enum Op {
    Add(Req),
    /// One iteration; the seed draws the accepted counts; `abort_in_flight` aborts the plan's
    /// request at that index (mod B) between schedule and report; `stop_string`: `(i, k)`, the
    /// report finishes the plan's request at index i (mod B) with a stop string that keeps
    /// `1 + k % emitted` of its emitted tokens.
    Step {
        seed: u64,
        abort_in_flight: Option<usize>,
        stop_string: Option<(usize, usize)>,
    },
    /// Abort (or finish with a stop string) the live request at this index (mod live count).
    Abort(usize, bool),
    /// Fixed mode only: the steps of the next decode iterations.
    SetSteps(u32),
}

#[derive(Debug, Clone)]
struct Workload {
    cfg: SchedulerConfig,
    adaptive: Option<AdaptiveConfig>,
    initial_steps: u32,
    ops: Vec<Op>,
}

fn req(ctx: u32) -> impl Strategy<Value = Req> {
    (
        1..ctx as u64,
        1i64..40,
        prop::collection::vec(0i64..40, 0..2),
        any::<bool>(),
    )
        .prop_map(|(prompt_len, max_new, stop, ignore_eos)| Req {
            prompt_len,
            max_new,
            stop,
            ignore_eos,
        })
}

fn op(ctx: u32) -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => req(ctx).prop_map(Op::Add),
        8 => (any::<u64>(), prop::option::weighted(0.1, 0usize..8),
              prop::option::weighted(0.1, (0usize..8, 0usize..8)))
            .prop_map(|(seed, abort_in_flight, stop_string)| Op::Step { seed, abort_in_flight, stop_string }),
        1 => (0usize..8, any::<bool>()).prop_map(|(i, stop)| Op::Abort(i, stop)),
        1 => (0u32..8).prop_map(Op::SetSteps),
    ]
}

fn adaptive() -> impl Strategy<Value = Option<AdaptiveConfig>> {
    prop_oneof![
        Just(None),
        Just(Some(AdaptiveConfig::default_config())),
        Just(Some(
            AdaptiveConfig::from_json(
                r#"{"warmup_batches": 0, "update_interval": 1, "ema_alpha": 0.5,
                    "1": {"candidate_steps": [0, 2, 5]}, "3": {"candidate_steps": [0, 1]}}"#
            )
            .unwrap()
        )),
        // issue 28: a verify length per request (KV reserved for each request's own length)
        Just(Some(
            AdaptiveConfig::from_json(r#"{"strategy": "goodput", "verify": "per_request", "1": {"candidate_steps": [0, 1, 3, 5]}}"#)
                .unwrap()
        )),
    ]
}

fn workload() -> impl Strategy<Value = Workload> {
    (
        2u32..40,
        1u32..6,
        0u32..6,
        1u32..6,
        1u32..6,
        1u32..40,
        any::<bool>(),
        adaptive(),
        0u32..8,
    )
        .prop_flat_map(
            |(
                ctx,
                page_size,
                extra_pages,
                max_running,
                max_queued,
                prefill,
                eos,
                adaptive,
                steps,
            )| {
                let cfg = SchedulerConfig {
                    max_running_requests: max_running,
                    max_queued_requests: max_queued,
                    max_prefill_tokens: prefill,
                    context_length: ctx,
                    num_pages: ctx.div_ceil(page_size) + extra_pages,
                    page_size,
                    eos_token_ids: if eos { vec![EOS] } else { vec![] },
                    record_trace: true,
                    // a third of the cases also cap one request's chunk below the budget
                    chunked_prefill_size: (prefill % 3 == 0).then_some(1 + prefill / 3),
                    skip_zero_step_draft_extend: !eos,
                    // half the cases share prompt pages through the prefix cache (every
                    // prompt starts the same way, so most admissions hit)
                    enable_prefix_caching: (max_queued + prefill) % 2 == 0,
                };
                let initial_steps = match &adaptive {
                    Some(c) => c.candidate_union()[steps as usize % c.candidate_union().len()],
                    None => steps,
                };
                prop::collection::vec(op(ctx), 1..80).prop_map(move |ops| Workload {
                    cfg: cfg.clone(),
                    adaptive: adaptive.clone(),
                    initial_steps,
                    ops,
                })
            },
        )
}

/// What the test knows of each request: its prompt, limits and the output streamed so far.
struct Model {
    reqs: HashMap<u64, (Vec<i64>, Req)>,
    streamed: HashMap<u64, Vec<i64>>,
    finished: HashMap<u64, Finished>,
    /// The row each request got at its last prefill chunk from position 0.
    rows: HashMap<u64, i64>,
}

impl Model {
    /// The output a request must end with when nothing aborts it.
    fn expected_output(&self, id: u64, cfg: &SchedulerConfig) -> (Vec<i64>, FinishReason) {
        let (prompt, r) = &self.reqs[&id];
        let mut out = vec![];
        let mut pos = prompt.len() as u64;
        loop {
            let t = tok(id, pos);
            out.push(t);
            pos += 1;
            if (!r.ignore_eos && cfg.eos_token_ids.contains(&t)) || r.stop.contains(&t) {
                return (out, FinishReason::Stop(Some(t)));
            }
            if out.len() as i64 >= r.max_new || pos >= u64::from(cfg.context_length) {
                return (out, FinishReason::Length);
            }
        }
    }

    fn finish(&mut self, f: Finished) -> Result<(), TestCaseError> {
        prop_assert!(
            self.reqs.contains_key(&f.request_id),
            "unknown request finished: {:?}",
            f
        );
        prop_assert!(
            self.finished.insert(f.request_id, f).is_none(),
            "request {} finished twice",
            f.request_id
        );
        Ok(())
    }
}

fn check_plan(
    s: &Scheduler,
    plan: &Plan,
    model: &Model,
    cfg: &SchedulerConfig,
) -> Result<(), TestCaseError> {
    let b = plan.batch_size();
    prop_assert!(b >= 1);
    // a draft tree's scratch slots: B * max(N, K (D - 1)), none of them a slot the plan writes
    // as a chain
    if plan.tree_topk > 1 {
        let per = specdial_core::scheduler::scratch_per_request(
            plan.steps,
            plan.tree_topk,
            plan.num_draft_tokens,
        );
        prop_assert_eq!(plan.scratch_loc.len() as u64, b as u64 * per);
        let chain: std::collections::HashSet<i64> = plan.out_loc.iter().copied().collect();
        prop_assert!(plan.scratch_loc.iter().all(|x| !chain.contains(x)));
    } else {
        prop_assert!(plan.scratch_loc.is_empty());
    }
    prop_assert!(b <= cfg.max_running_requests as usize);
    prop_assert_eq!(plan.qo_lens.len(), b);
    prop_assert_eq!(plan.kv_lens.len(), b);
    prop_assert_eq!(plan.out_loc.len() as i64, plan.qo_lens.iter().sum::<i64>());
    prop_assert_eq!(plan.rows.len(), b);
    let distinct: HashSet<i64> = plan.rows.iter().copied().collect();
    prop_assert_eq!(distinct.len(), b, "rows shared in one plan: {:?}", &plan.rows);
    let layout = s.plan_kv_layout();
    if layout {
        prop_assert_eq!(
            plan.kv_indices.len() as i64,
            plan.kv_lens.iter().sum::<i64>()
        );
        prop_assert_eq!(plan.page_table_offsets.len(), b + 1);
    } else {
        prop_assert!(plan.kv_indices.is_empty() && plan.page_table.is_empty());
        prop_assert!(plan.page_table_offsets.is_empty());
    }
    let caching = cfg.enable_prefix_caching;
    let ps = i64::from(cfg.page_size);
    // Written slots are never shared and never in a cached page; without the cache no slot is.
    let mut seen_slots = HashSet::new();
    prop_assert!(plan
        .out_loc
        .iter()
        .all(|&slot| s.pool().holders((slot / ps) as u32).is_none()));
    let (mut cached_at, mut written) = (0usize, HashSet::new());
    prop_assert!(plan.out_loc.iter().all(|&slot| written.insert(slot)), "a slot written twice");
    let (mut kv_at, mut out_at, mut in_at) = (0usize, 0usize, 0usize);
    for i in 0..b {
        let id = plan.request_ids[i] as u64;
        let (kv_len, qo) = (plan.kv_lens[i] as u64, plan.qo_lens[i] as u64);
        let row = plan.rows[i];
        prop_assert!((0..i64::from(cfg.max_running_requests)).contains(&row));
        prop_assert_eq!(s.row_of(id).map(i64::from), Some(row));
        let cached = if plan.kind == PlanKind::Prefill { plan.cached_lens[i] as u64 } else { 0 };
        prop_assert!(caching || cached == 0);
        if kv_len - qo != cached || plan.kind == PlanKind::Decode {
            // not a (re)start: the row it got at its last start
            prop_assert_eq!(model.rows.get(&id), Some(&row), "request {} changed rows", id);
        }
        prop_assert_eq!(s.pool().len(id).unwrap(), kv_len);
        prop_assert!(
            kv_len < u64::from(cfg.context_length),
            "KV past the context end"
        );
        let slots = s.pool().kv_indices(id, 0, kv_len).unwrap();
        if layout {
            prop_assert_eq!(&plan.kv_indices[kv_at..kv_at + kv_len as usize], &slots[..]);
        }
        prop_assert_eq!(
            &plan.out_loc[out_at..out_at + qo as usize],
            &slots[(kv_len - qo) as usize..]
        );
        for &slot in &slots {
            let shared = !seen_slots.insert(slot);
            prop_assert!(!shared || caching, "slot {} shared", slot);
            prop_assert!(!shared || s.pool().holders((slot / ps) as u32).is_some());
        }
        let pages: Vec<i64> = s
            .pool()
            .pages(id)
            .unwrap()
            .iter()
            .map(|&p| i64::from(p))
            .collect();
        if layout {
            let (p0, p1) = (
                plan.page_table_offsets[i] as usize,
                plan.page_table_offsets[i + 1] as usize,
            );
            prop_assert_eq!(&plan.page_table[p0..p1], &pages[..]);
        }
        // Known tokens of the request: prompt then streamed output.
        let (prompt, _) = &model.reqs[&id];
        let mut tokens = prompt.clone();
        tokens.extend(&model.streamed[&id]);
        match plan.kind {
            PlanKind::Prefill => {
                let start = (kv_len - qo) as usize;
                // the cached prefix: whole pages, at least one token left to prefill
                let c = cached as usize;
                prop_assert_eq!(c % ps as usize, 0);
                prop_assert_eq!(&plan.cached_ids[cached_at..cached_at + c], &tokens[..c]);
                prop_assert_eq!(&plan.cached_kv_indices[cached_at..cached_at + c], &slots[..c]);
                cached_at += c;
                prop_assert_eq!(
                    &plan.input_ids[in_at..in_at + qo as usize],
                    &tokens[start..kv_len as usize]
                );
                let expected: Vec<i64> = (start as i64..kv_len as i64).collect();
                prop_assert_eq!(&plan.positions[in_at..in_at + qo as usize], &expected[..]);
                let done = plan.prefill_done[i] == 1;
                let target = if tokens.len() == prompt.len() {
                    prompt.len()
                } else {
                    tokens.len() - 1
                };
                prop_assert_eq!(done, kv_len as usize == target);
                prop_assert_eq!(
                    plan.sample_first[i] == 1,
                    done && tokens.len() == prompt.len()
                );
                in_at += qo as usize;
            }
            PlanKind::Decode => {
                let l = plan.positions[i] as u64;
                prop_assert_eq!(l + 1, tokens.len() as u64, "decode input is the last token");
                prop_assert_eq!(plan.input_ids[i], *tokens.last().unwrap());
                prop_assert_eq!(qo, plan.steps_per_request[i] as u64 + 1);
                prop_assert!(plan.steps_per_request[i] <= i64::from(plan.steps));
            }
        }
        kv_at += kv_len as usize;
        out_at += qo as usize;
    }
    Ok(())
}

/// Schedules, runs the fake model, reports; returns false when there was nothing to run.
fn iteration(
    s: &mut Scheduler,
    model: &mut Model,
    cfg: &SchedulerConfig,
    seed: u64,
    abort_in_flight: Option<usize>,
    stop_string: Option<(usize, usize)>,
) -> Result<bool, TestCaseError> {
    let Some(plan) = s.schedule().unwrap() else {
        return Ok(false);
    };
    check_plan(s, &plan, model, cfg)?;
    for b in 0..plan.batch_size() {
        if plan.kind == PlanKind::Prefill && plan.kv_lens[b] - plan.qo_lens[b] == plan.cached_lens[b] {
            model.rows.insert(plan.request_ids[b] as u64, plan.rows[b]);
        }
    }
    if abort_in_flight.is_some_and(|i| i % 4 == 3) {
        // the step failed: abandon the plan (its live requests are aborted)
        let live: Vec<u64> = plan
            .request_ids
            .iter()
            .map(|&id| id as u64)
            .filter(|&id| s.request_state(id).is_some())
            .collect();
        let finished = s.abandon_plan().unwrap();
        prop_assert!(!s.plan_in_flight());
        prop_assert_eq!(
            finished.iter().map(|f| f.request_id).collect::<Vec<_>>(),
            live
        );
        for f in finished {
            prop_assert_eq!(f.reason, FinishReason::Abort);
            model.finish(f)?;
        }
        return Ok(true);
    }
    for &id in &plan.preempted {
        prop_assert_eq!(s.request_state(id as u64), Some(RequestState::Waiting));
    }
    let (mut tokens, mut offsets, mut accepted) = (vec![], vec![0i64], vec![]);
    let mut x = seed;
    for b in 0..plan.batch_size() {
        let id = plan.request_ids[b] as u64;
        match plan.kind {
            PlanKind::Prefill => {
                if plan.sample_first[b] == 1 {
                    tokens.push(tok(id, plan.kv_lens[b] as u64));
                }
            }
            PlanKind::Decode => {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let a = ((x >> 33) % (plan.steps_per_request[b] as u64 + 1)) as i64;
                let l = plan.positions[b] as u64;
                tokens.extend((l + 1..=l + a as u64 + 1).map(|p| tok(id, p)));
                accepted.push(a);
            }
        }
        offsets.push(tokens.len() as i64);
    }
    let bs = plan.batch_size();
    if let Some(i) = abort_in_flight {
        let id = plan.request_ids[i % bs] as u64;
        let f = s.abort(id).unwrap();
        model.finish(f)?;
    }
    // a stop string completed at a random emitted token of a request still live
    let stopped: Vec<(u64, usize)> = stop_string
        .map(|(i, k)| (i % bs, k))
        .filter(|&(b, _)| abort_in_flight.is_none_or(|a| a % bs != b) && offsets[b + 1] > offsets[b])
        .map(|(b, k)| (plan.request_ids[b] as u64, 1 + k % (offsets[b + 1] - offsets[b]) as usize))
        .into_iter()
        .collect();
    let acc = (plan.kind == PlanKind::Decode).then_some(&accepted[..]);
    let extras = ReportExtras { stop_strings: &stopped, ..Default::default() };
    let out = s.report_with(&tokens, &offsets, acc, extras).unwrap();
    prop_assert_eq!(&out.request_ids, &plan.request_ids);
    for &(id, keep) in &stopped {
        // the tokens after the completing one are dropped; a core rule may finish it earlier
        let b = plan.request_ids.iter().position(|&x| x as u64 == id).unwrap();
        let new = &out.new_tokens[out.new_offsets[b] as usize..out.new_offsets[b + 1] as usize];
        let f = out.finished.iter().find(|f| f.request_id == id);
        prop_assert!(f.is_some(), "request {} was not finished by its stop string", id);
        let f = f.unwrap();
        let emitted = &tokens[offsets[b] as usize..offsets[b + 1] as usize];
        prop_assert!(new.len() <= keep && new == &emitted[..new.len()], "{:?} {:?}", new, emitted);
        prop_assert!(f.reason != FinishReason::Stop(None) || new.len() == keep, "{:?}", f);
    }
    for b in 0..plan.batch_size() {
        let id = plan.request_ids[b] as u64;
        let new = &out.new_tokens[out.new_offsets[b] as usize..out.new_offsets[b + 1] as usize];
        model.streamed.get_mut(&id).unwrap().extend_from_slice(new);
        let r = &model.reqs[&id].1;
        prop_assert!(
            model.streamed[&id].len() as i64 <= r.max_new,
            "output past max_new_tokens"
        );
    }
    for f in out.finished {
        prop_assert_eq!(f.output_len, model.streamed[&f.request_id].len() as u64);
        model.finish(f)?;
    }
    Ok(true)
}

fn check_bounds(s: &Scheduler, cfg: &SchedulerConfig) -> Result<(), TestCaseError> {
    if let Err(e) = s.check_invariants() {
        return Err(TestCaseError::fail(e));
    }
    let st = s.stats();
    prop_assert!(st.running + st.prefilling <= cfg.max_running_requests as usize);
    // new requests wait up to max_queued_requests beyond the running slots still free for them
    let free = (cfg.max_running_requests as usize)
        .saturating_sub(st.running + st.prefilling + st.queued_preempted);
    prop_assert!(st.queued - st.queued_preempted <= cfg.max_queued_requests as usize + free);
    prop_assert_eq!(
        s.queued_beyond_free_rows(),
        (st.queued - st.queued_preempted).saturating_sub(free)
    );
    prop_assert!(st.kv_pages_used <= st.kv_pages_total);
    prop_assert_eq!(st.kv_pages_used, s.pool().num_held_pages());
    prop_assert_eq!(st.cached_pages, s.pool().num_cached_pages());
    Ok(())
}

fn run(w: Workload) -> Result<(), TestCaseError> {
    let cfg = w.cfg.clone();
    let source = match &w.adaptive {
        Some(c) => {
            StepsSource::Adaptive(AdaptiveSpeculativeParams::new(w.initial_steps, c.clone()))
        }
        None => StepsSource::Fixed(w.initial_steps),
    };
    let mut s = Scheduler::new(cfg.clone(), source).unwrap();
    // half the workloads plan with the full KV layout (kv_indices, page table)
    s.set_plan_kv_layout(w.ops.len() % 2 == 0);
    // a third of the fixed-steps workloads draft trees (issue 29): top-k 2 with steps + 1 nodes,
    // whose scratch slots every check_invariants call counts; skipped where they cannot fit
    if w.adaptive.is_none() && w.initial_steps > 0 && w.ops.len() % 3 == 0 {
        if let Err(e) = s.set_draft_tree(2, Some(w.initial_steps + 2)) {
            prop_assert!(e.to_string().contains("KV pages of scratch"), "{}", e);
        }
    }
    let mut model = Model {
        reqs: HashMap::new(),
        streamed: HashMap::new(),
        finished: HashMap::new(),
        rows: HashMap::new(),
    };
    let mut live: Vec<u64> = vec![];
    let mut added = 0u64;
    for op in w.ops {
        match op {
            Op::Add(r) => {
                let prompt: Vec<i64> = (0..r.prompt_len).map(|p| 100 + (p as i64 % 7)).collect();
                match s.add_request(prompt.clone(), r.max_new, r.stop.clone(), r.ignore_eos) {
                    Ok(id) => {
                        prop_assert_eq!(id, added);
                        added += 1;
                        model.reqs.insert(id, (prompt, r));
                        model.streamed.insert(id, vec![]);
                        live.push(id);
                    }
                    Err(specdial_core::SchedulerError::QueueFull { queued, max }) => {
                        prop_assert_eq!(max, cfg.max_queued_requests);
                        prop_assert_eq!(queued, max as usize);
                        prop_assert_eq!(s.queued_beyond_free_rows(), max as usize);
                    }
                    Err(e) => return Err(TestCaseError::fail(format!("unexpected {e}"))),
                }
            }
            Op::Step {
                seed,
                abort_in_flight,
                stop_string,
            } => {
                iteration(&mut s, &mut model, &cfg, seed, abort_in_flight, stop_string)?;
            }
            Op::Abort(i, stop) => {
                live.retain(|id| !model.finished.contains_key(id));
                if !live.is_empty() {
                    let id = live[i % live.len()];
                    let reason = if stop {
                        FinishReason::Stop(None)
                    } else {
                        FinishReason::Abort
                    };
                    let f = s.finish_request(id, reason).unwrap();
                    prop_assert_eq!(f.reason, reason);
                    model.finish(f)?;
                    prop_assert!(s.abort(id).is_none());
                }
            }
            Op::SetSteps(k) => {
                if w.adaptive.is_none() {
                    if let Err(e) = s.set_fixed_steps(Some(k)) {
                        // only a draft tree too small for depth k refuses
                        prop_assert!(s.draft_tree().is_some(), "{}", e);
                        prop_assert!(e.to_string().starts_with("speculative_num_draft_tokens"), "{}", e);
                    }
                }
            }
        }
        check_bounds(&s, &cfg)?;
    }
    // Drain: everything left must finish without help.
    let mut seed = 1u64;
    for _ in 0..20_000 {
        seed = seed.wrapping_mul(31).wrapping_add(7);
        if !iteration(&mut s, &mut model, &cfg, seed, None, None)? {
            break;
        }
        check_bounds(&s, &cfg)?;
    }
    prop_assert!(!s.has_unfinished(), "requests left behind: {:?}", s.stats());
    // only the cache holds pages now, and a flush frees every one
    prop_assert_eq!(s.pool().num_used_pages(), s.pool().num_cached_pages(), "page leak");
    prop_assert!(s.flush_cache());
    prop_assert_eq!(s.pool().num_used_pages(), 0, "page leak");
    prop_assert_eq!(s.pool().num_requests(), 0);
    prop_assert_eq!(s.rows_in_use(), 0, "row leak");
    // No request lost: each finished exactly once (checked in Model::finish) ...
    prop_assert_eq!(model.finished.len() as u64, added);
    let st = s.stats();
    prop_assert_eq!(st.requests_finished + st.requests_aborted, added);
    // ... and every request not stopped by the caller has exactly the output of its limits,
    // preempted or not.
    for (&id, f) in &model.finished {
        let streamed = &model.streamed[&id];
        if f.reason == FinishReason::Abort || f.reason == FinishReason::Stop(None) {
            let (full, _) = model.expected_output(id, &cfg);
            prop_assert!(
                full.starts_with(streamed),
                "request {} streamed a wrong prefix",
                id
            );
        } else {
            let (out, reason) = model.expected_output(id, &cfg);
            prop_assert_eq!(streamed, &out, "request {} output", id);
            prop_assert_eq!(f.reason, reason);
        }
    }
    prop_assert_eq!(
        st.tokens_generated,
        model.streamed.values().map(|v| v.len() as u64).sum::<u64>()
    );
    // The trace has one well-formed record per decode iteration.
    let trace = s.drain_trace();
    prop_assert_eq!(trace.len() as u64, st.decode_iterations);
    for t in &trace {
        prop_assert_eq!(t.accepted.len(), t.batch_size as usize);
        prop_assert!(t
            .accepted
            .iter()
            .all(|&a| a >= 0 && a <= i64::from(t.steps)));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(192))]

    #[test]
    fn random_workloads_keep_every_invariant(w in workload()) {
        run(w)?;
    }
}

/// A pool just big enough for one request, many long requests and steps up to 7: preemption
/// on almost every decode, and everything still completes with the exact outputs.
#[test]
fn tiny_pool_heavy_preemption() {
    let cfg = SchedulerConfig {
        max_running_requests: 4,
        max_queued_requests: 16,
        max_prefill_tokens: 5,
        context_length: 24,
        num_pages: 12,
        page_size: 2,
        eos_token_ids: vec![],
        record_trace: true,
        chunked_prefill_size: None,
        skip_zero_step_draft_extend: true,
        enable_prefix_caching: false,
    };
    let mut ops = vec![];
    for i in 0..12 {
        ops.push(Op::Add(Req {
            prompt_len: 3 + i % 9,
            max_new: 30,
            stop: vec![],
            ignore_eos: true,
        }));
    }
    for i in 0..40 {
        ops.push(Op::SetSteps([0, 7, 3][i % 3]));
        ops.push(Op::Step {
            seed: i as u64,
            abort_in_flight: None,
            stop_string: None,
        });
    }
    let w = Workload {
        cfg,
        adaptive: None,
        initial_steps: 7,
        ops,
    };
    run(w.clone()).unwrap();
    // And the run does preempt.
    let mut s = Scheduler::new(w.cfg.clone(), StepsSource::Fixed(7)).unwrap();
    for i in 0..12u64 {
        s.add_request(vec![1; 3 + (i % 9) as usize], 30, vec![], true)
            .unwrap();
    }
    let mut model = Model {
        reqs: HashMap::new(),
        streamed: HashMap::new(),
        finished: HashMap::new(),
        rows: HashMap::new(),
    };
    for i in 0..12u64 {
        let r = Req {
            prompt_len: 3 + i % 9,
            max_new: 30,
            stop: vec![],
            ignore_eos: true,
        };
        model.reqs.insert(i, (vec![1; r.prompt_len as usize], r));
        model.streamed.insert(i, vec![]);
    }
    let mut seed = 0;
    while iteration(&mut s, &mut model, &w.cfg, seed, None, None).unwrap() {
        seed += 1;
    }
    assert!(s.stats().preemptions > 0);
    assert_eq!(model.finished.len(), 12);
}
