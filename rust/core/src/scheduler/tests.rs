//! Unit tests of the scheduler's rules, one or more per rule of the module docs.

use super::*;
use crate::config::AdaptiveConfig;

pub(super) fn config(num_pages: u32, page_size: u32) -> SchedulerConfig {
    SchedulerConfig {
        max_running_requests: 8,
        max_queued_requests: 16,
        max_prefill_tokens: 64,
        context_length: 64,
        num_pages,
        page_size,
        eos_token_ids: vec![],
        record_trace: false,
        chunked_prefill_size: None,
        skip_zero_step_draft_extend: true,
        enable_prefix_caching: false,
    }
}

pub(super) fn fixed(cfg: SchedulerConfig, steps: u32) -> Scheduler {
    Scheduler::new(cfg, StepsSource::Fixed(steps)).unwrap()
}

/// The fake model: the token at position `pos` of request `id` (never 0, which tests use as EOS).
pub(super) fn tok(id: i64, pos: i64) -> i64 {
    1 + (id * 31 + pos * 7) % 97
}

/// Runs one iteration with the fake model; decode accepts `accept(id, steps_r)` drafts.
pub(super) fn step(
    s: &mut Scheduler,
    accept: &mut dyn FnMut(i64, i64) -> i64,
) -> Option<(Plan, ReportOutcome)> {
    let plan = s.schedule().unwrap()?;
    let (mut tokens, mut offsets, mut accepted) = (vec![], vec![0i64], vec![]);
    for b in 0..plan.batch_size() {
        let id = plan.request_ids[b];
        match plan.kind {
            PlanKind::Prefill => {
                if plan.sample_first[b] == 1 {
                    tokens.push(tok(id, plan.kv_lens[b]));
                }
            }
            PlanKind::Decode => {
                let a = accept(id, plan.steps_per_request[b]).min(plan.steps_per_request[b]);
                let l = plan.positions[b];
                tokens.extend((l + 1..=l + a + 1).map(|p| tok(id, p)));
                accepted.push(a);
            }
        }
        offsets.push(tokens.len() as i64);
    }
    let acc = (plan.kind == PlanKind::Decode).then_some(&accepted[..]);
    let out = s.report(&tokens, &offsets, acc).unwrap();
    s.check_invariants().unwrap();
    Some((plan, out))
}

pub(super) fn full(_: i64, steps_r: i64) -> i64 {
    steps_r
}

/// Runs until nothing is left; returns every finished record.
pub(super) fn run_all(s: &mut Scheduler, accept: &mut dyn FnMut(i64, i64) -> i64) -> Vec<Finished> {
    let mut finished = vec![];
    for _ in 0..10_000 {
        match step(s, accept) {
            Some((_, out)) => finished.extend(out.finished),
            None => break,
        }
    }
    assert!(!s.has_unfinished());
    assert_eq!(s.pool().num_used_pages(), 0);
    finished
}

#[test]
fn config_errors_name_the_field() {
    let err = |c: SchedulerConfig| {
        Scheduler::new(c, StepsSource::Fixed(0))
            .unwrap_err()
            .to_string()
    };
    assert!(err(SchedulerConfig {
        max_running_requests: 0,
        ..config(8, 8)
    })
    .starts_with("max_running_requests: must be >= 1"));
    assert!(err(SchedulerConfig {
        max_queued_requests: 0,
        ..config(8, 8)
    })
    .starts_with("max_queued_requests"));
    assert!(err(SchedulerConfig {
        max_prefill_tokens: 0,
        ..config(8, 8)
    })
    .starts_with("max_prefill_tokens"));
    assert!(err(SchedulerConfig {
        context_length: 1,
        ..config(8, 8)
    })
    .starts_with("context_length: must be >= 2"));
    assert!(err(config(3, 8)).contains("cannot hold one request of context_length = 64"));
    assert!(err(SchedulerConfig {
        eos_token_ids: vec![2, -1],
        ..config(8, 8)
    })
    .contains("eos_token_ids[1] = -1"));
    let e = Scheduler::new(config(8, 8), StepsSource::Fixed(33)).unwrap_err();
    assert!(e
        .to_string()
        .starts_with("speculative_num_steps: must be in 0..=32"));
    assert!(SchedulerConfig::default().validate().is_ok());
}

#[test]
fn invalid_requests_name_the_field_and_change_nothing() {
    let mut s = fixed(config(8, 8), 0);
    let e = |r: Result<u64, SchedulerError>| r.unwrap_err().to_string();
    assert_eq!(
        e(s.add_request(vec![], 4, vec![], false)),
        "prompt_ids: must not be empty"
    );
    assert!(e(s.add_request(vec![1; 64], 4, vec![], false))
        .starts_with("prompt_ids: has 64 tokens, more than context_length - 1 = 63"));
    assert!(e(s.add_request(vec![1, -2], 4, vec![], false))
        .starts_with("prompt_ids: prompt_ids[1] = -2"));
    assert_eq!(
        e(s.add_request(vec![1], 0, vec![], false)),
        "max_new_tokens: must be >= 1, got 0"
    );
    assert!(e(s.add_request(vec![1], 1, vec![-5], false))
        .starts_with("stop_token_ids: stop_token_ids[0] = -5"));
    assert!(matches!(
        s.add_request(vec![], 0, vec![], false),
        Err(SchedulerError::InvalidRequest {
            field: "prompt_ids",
            ..
        })
    ));
    assert!(!s.has_unfinished());
    // The longest prompt allowed: context_length - 1.
    assert_eq!(s.add_request(vec![1; 63], 4, vec![], false), Ok(0));
}

#[test]
fn queue_full_is_a_typed_error_and_preempted_requests_do_not_count() {
    let mut s = fixed(
        SchedulerConfig {
            max_running_requests: 3,
            max_queued_requests: 2,
            ..config(8, 8)
        },
        0,
    );
    // An idle scheduler takes max_running + max_queued new requests before an iteration:
    // the first 3 have running slots waiting for them, only the next 2 are "queued".
    for id in 0..5 {
        assert_eq!(s.add_request(vec![1], 4, vec![], false), Ok(id));
    }
    assert_eq!(s.queued_beyond_free_rows(), 2);
    let err = s.add_request(vec![1], 4, vec![], false).unwrap_err();
    assert_eq!(err, SchedulerError::QueueFull { queued: 2, max: 2 });
    assert!(err
        .to_string()
        .starts_with("queue full: 2 requests are waiting for admission beyond the free"));
    // Invalid input is reported before a full queue.
    assert!(matches!(
        s.add_request(vec![], 4, vec![], false),
        Err(SchedulerError::InvalidRequest { .. })
    ));
    // Admission fills the running slots; the 2 beyond them are still queued.
    step(&mut s, &mut full).unwrap();
    assert_eq!((s.num_queued(), s.queued_beyond_free_rows()), (2, 2));
    assert!(s.add_request(vec![1], 4, vec![], false).is_err());
    s.check_invariants().unwrap();
    // A finished request frees a slot: one more new request fits.
    s.abort(0).unwrap();
    assert_eq!(s.queued_beyond_free_rows(), 1);
    assert_eq!(s.add_request(vec![1], 4, vec![], false), Ok(5));
    s.check_invariants().unwrap();
}

#[test]
fn admission_is_fcfs_within_the_budget() {
    let mut s = fixed(
        SchedulerConfig {
            max_prefill_tokens: 10,
            ..config(64, 4)
        },
        0,
    );
    s.set_plan_kv_layout(true);
    for n in [4, 4, 2, 1] {
        s.add_request(vec![1; n], 4, vec![], false).unwrap();
    }
    let (plan, out) = step(&mut s, &mut full).unwrap();
    // 4 + 4 + 2 = 10 tokens: the budget; request 3 waits even though 1 token would not fit.
    assert_eq!(plan.kind, PlanKind::Prefill);
    assert_eq!(plan.request_ids, vec![0, 1, 2]);
    assert_eq!(plan.qo_lens, vec![4, 4, 2]);
    assert_eq!(plan.positions, vec![0, 1, 2, 3, 0, 1, 2, 3, 0, 1]);
    assert_eq!(plan.out_loc, vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
    assert_eq!(plan.kv_indices, plan.out_loc);
    assert_eq!(plan.page_table, vec![0, 1, 2]);
    assert_eq!(plan.page_table_offsets, vec![0, 1, 2, 3]);
    assert_eq!(plan.prefill_done, vec![1, 1, 1]);
    assert_eq!(plan.sample_first, vec![1, 1, 1]);
    assert_eq!(plan.logits_indices, vec![3, 7, 9]);
    assert_eq!(out.new_tokens, vec![tok(0, 4), tok(1, 4), tok(2, 2)]);
    assert_eq!(out.new_offsets, vec![0, 1, 2, 3]);
    assert_eq!(s.request_state(3), Some(RequestState::Waiting));
    // Prefill keeps priority: request 3 next.
    let (plan, _) = step(&mut s, &mut full).unwrap();
    assert_eq!(
        (plan.kind, plan.request_ids.clone()),
        (PlanKind::Prefill, vec![3])
    );
    let (plan, _) = step(&mut s, &mut full).unwrap();
    assert_eq!(
        (plan.kind, plan.request_ids),
        (PlanKind::Decode, vec![0, 1, 2, 3])
    );
}

#[test]
fn fcfs_blocks_on_the_head_when_pages_do_not_fit() {
    // 8 pages of 8 tokens; the head needs most of the pool while request 0 runs.
    let mut s = fixed(
        SchedulerConfig {
            max_prefill_tokens: 64,
            ..config(8, 8)
        },
        0,
    );
    s.add_request(vec![1; 40], 20, vec![], false).unwrap(); // 5 pages + 1 for its decode
    step(&mut s, &mut full).unwrap();
    s.add_request(vec![1; 30], 4, vec![], false).unwrap(); // 4 pages: does not fit
    s.add_request(vec![1; 2], 4, vec![], false).unwrap(); // would fit, but FCFS
    let (plan, _) = step(&mut s, &mut full).unwrap();
    assert_eq!((plan.kind, plan.request_ids), (PlanKind::Decode, vec![0]));
    assert_eq!(s.request_state(2), Some(RequestState::Waiting));
}

#[test]
fn long_prompts_are_chunked_and_alternate_with_decode() {
    let mut s = fixed(
        SchedulerConfig {
            max_prefill_tokens: 4,
            ..config(64, 4)
        },
        0,
    );
    s.add_request(vec![5; 2], 30, vec![], false).unwrap();
    step(&mut s, &mut full).unwrap(); // request 0 prefilled
    s.add_request((0..10).collect(), 30, vec![], false).unwrap();
    let mut kinds = vec![];
    for _ in 0..6 {
        let (plan, _) = step(&mut s, &mut full).unwrap();
        kinds.push(plan.kind);
        if plan.kind == PlanKind::Prefill {
            assert_eq!(plan.request_ids, vec![1]);
        }
    }
    use PlanKind::{Decode as D, Prefill as P};
    // Chunks of 4, 4, 2 tokens; a decode after each unfinished chunk; then decode both.
    assert_eq!(kinds, vec![P, D, P, D, P, D]);
    assert_eq!(s.request_state(1), Some(RequestState::Running));
    assert_eq!(s.output_ids(1).unwrap(), &[tok(1, 10), tok(1, 11)]);
    assert_eq!(s.stats().prefill_tokens, 12);
}

#[test]
fn chunk_arrays_cover_the_chunk_and_the_whole_context() {
    let mut s = fixed(
        SchedulerConfig {
            max_prefill_tokens: 3,
            ..config(64, 2)
        },
        0,
    );
    s.set_plan_kv_layout(true);
    s.add_request((10..17).collect(), 5, vec![], false).unwrap();
    let (p1, o1) = step(&mut s, &mut full).unwrap();
    assert_eq!(
        (p1.input_ids.clone(), p1.positions.clone()),
        (vec![10, 11, 12], vec![0, 1, 2])
    );
    assert_eq!(
        (p1.prefill_done.clone(), p1.sample_first.clone()),
        (vec![0], vec![0])
    );
    assert!(p1.logits_indices.is_empty() && o1.new_tokens.is_empty());
    assert_eq!(s.request_state(0), Some(RequestState::Prefilling));
    // Nothing is running, so the chunks follow each other.
    let (p2, _) = step(&mut s, &mut full).unwrap();
    assert_eq!(
        (p2.input_ids.clone(), p2.positions.clone()),
        (vec![13, 14, 15], vec![3, 4, 5])
    );
    assert_eq!((p2.qo_lens.clone(), p2.kv_lens.clone()), (vec![3], vec![6]));
    assert_eq!(p2.kv_indices, s.pool().kv_indices(0, 0, 6).unwrap());
    assert_eq!(p2.out_loc, s.pool().kv_indices(0, 3, 6).unwrap());
    let (p3, o3) = step(&mut s, &mut full).unwrap();
    assert_eq!(
        (
            p3.prefill_done.clone(),
            p3.sample_first.clone(),
            p3.logits_indices.clone()
        ),
        (vec![1], vec![1], vec![0])
    );
    assert_eq!(o3.new_tokens, vec![tok(0, 7)]);
}

#[test]
fn decode_plan_layout_and_truncation() {
    let mut s = fixed(config(64, 4), 3);
    s.set_plan_kv_layout(true);
    s.add_request(vec![7; 5], 20, vec![], false).unwrap();
    s.add_request(vec![8; 2], 20, vec![], false).unwrap();
    step(&mut s, &mut full).unwrap();
    let plan = s.schedule().unwrap().unwrap();
    assert_eq!(plan.kind, PlanKind::Decode);
    assert_eq!(
        (plan.steps, plan.graph_bs, plan.graph_key()),
        (3, None, GraphKey::Chain(3, 2))
    );
    assert_eq!(plan.input_ids, vec![tok(0, 5), tok(1, 2)]);
    assert_eq!(plan.positions, vec![5, 2]);
    assert_eq!(plan.steps_per_request, vec![3, 3]);
    assert_eq!(plan.qo_lens, vec![4, 4]);
    assert_eq!(plan.kv_lens, vec![9, 6]);
    let mut out_loc = s.pool().kv_indices(0, 5, 9).unwrap();
    out_loc.extend(s.pool().kv_indices(1, 2, 6).unwrap());
    assert_eq!(plan.out_loc, out_loc);
    let mut kv = s.pool().kv_indices(0, 0, 9).unwrap();
    kv.extend(s.pool().kv_indices(1, 0, 6).unwrap());
    assert_eq!(plan.kv_indices, kv);
    assert_eq!(plan.page_table_offsets, vec![0, 3, 5]);
    assert!(plan.prefill_done.is_empty() && plan.sample_first.is_empty());
    assert_eq!(plan.out_loc_padded(-1), plan.out_loc);
    // Request 0 accepts 1 draft, request 1 accepts 3.
    let tokens = vec![11, 12, 21, 22, 23, 24];
    let out = s.report(&tokens, &[0, 2, 6], Some(&[1, 3])).unwrap();
    assert_eq!(out.new_tokens, tokens);
    assert_eq!(out.new_offsets, vec![0, 2, 6]);
    // KV keeps L ..= L + accepted: 5 + 2 and 2 + 4 positions.
    assert_eq!(s.pool().len(0), Ok(7));
    assert_eq!(s.pool().len(1), Ok(6));
    s.check_invariants().unwrap();
    let plan = s.schedule().unwrap().unwrap();
    assert_eq!(plan.input_ids, vec![12, 24]);
    assert_eq!(plan.positions, vec![7, 6]);
}

#[test]
fn steps_are_capped_by_max_new_tokens_and_the_context_end() {
    let mut s = fixed(
        SchedulerConfig {
            context_length: 16,
            ..config(64, 4)
        },
        5,
    );
    s.add_request(vec![1; 3], 3, vec![], false).unwrap(); // 2 more after the first token
    s.add_request(vec![1; 12], 50, vec![], false).unwrap(); // 3 more until 16 tokens
    s.add_request(vec![1; 2], 50, vec![], false).unwrap(); // uncapped
    step(&mut s, &mut full).unwrap();
    let (plan, out) = step(&mut s, &mut full).unwrap();
    assert_eq!(plan.steps, 5);
    assert_eq!(plan.steps_per_request, vec![1, 2, 5]);
    assert_eq!(plan.qo_lens, vec![2, 3, 6]);
    // Padded layout for a fixed [B, steps + 1] graph.
    let padded = plan.out_loc_padded(-1);
    assert_eq!(padded.len(), 18);
    assert_eq!(
        &padded[..6],
        &[plan.out_loc[0], plan.out_loc[1], -1, -1, -1, -1]
    );
    // Both capped requests emitted exactly what they could and finished with reason length.
    let fin: Vec<_> = out
        .finished
        .iter()
        .map(|f| (f.request_id, f.reason, f.output_len))
        .collect();
    assert_eq!(
        fin,
        vec![(0, FinishReason::Length, 3), (1, FinishReason::Length, 4)]
    );
    s.check_invariants().unwrap();
}

#[test]
fn eos_stop_tokens_and_max_new_tokens_truncate_the_output() {
    let cfg = SchedulerConfig {
        eos_token_ids: vec![0],
        ..config(64, 4)
    };
    let mut s = fixed(cfg, 4);
    let eos = s.add_request(vec![1; 2], 20, vec![], false).unwrap();
    let stop = s.add_request(vec![1; 2], 20, vec![77], false).unwrap();
    let ignore = s.add_request(vec![1; 2], 20, vec![], true).unwrap();
    let len = s.add_request(vec![1; 2], 3, vec![], false).unwrap();
    step(&mut s, &mut full).unwrap();
    let plan = s.schedule().unwrap().unwrap();
    assert_eq!(plan.steps_per_request, vec![4, 4, 4, 1]);
    let emitted: Vec<Vec<i64>> = vec![
        vec![5, 0, 6, 7, 8],
        vec![5, 77, 6],
        vec![0, 0, 9],
        vec![3, 4],
    ];
    let tokens: Vec<i64> = emitted.concat();
    let mut offsets = vec![0];
    for e in &emitted {
        offsets.push(offsets.last().unwrap() + e.len() as i64);
    }
    let out = s.report(&tokens, &offsets, None).unwrap();
    assert_eq!(out.new_tokens, vec![5, 0, 5, 77, 0, 0, 9, 3, 4]);
    assert_eq!(out.new_offsets, vec![0, 2, 4, 7, 9]);
    let fin: Vec<_> = out
        .finished
        .iter()
        .map(|f| (f.request_id, f.reason))
        .collect();
    assert_eq!(
        fin,
        vec![
            (eos, FinishReason::Stop(Some(0))),
            (stop, FinishReason::Stop(Some(77))),
            (len, FinishReason::Length)
        ]
    );
    assert_eq!(
        s.output_ids(ignore).unwrap(),
        &[tok(ignore as i64, 2), 0, 0, 9]
    );
    assert_eq!(s.pool().num_requests(), 1);
    assert_eq!(s.stats().tokens_generated, 4 + 9);
    s.check_invariants().unwrap();
}

#[test]
fn the_first_token_can_finish_a_request() {
    let cfg = SchedulerConfig {
        eos_token_ids: vec![tok(1, 3)],
        ..config(64, 4)
    };
    let mut s = fixed(cfg, 2);
    s.add_request(vec![1; 3], 1, vec![], false).unwrap(); // max_new_tokens 1
    s.add_request(vec![1; 3], 9, vec![], false).unwrap(); // first token is EOS
    let (_, out) = step(&mut s, &mut full).unwrap();
    let fin: Vec<_> = out
        .finished
        .iter()
        .map(|f| (f.request_id, f.reason, f.output_len))
        .collect();
    assert_eq!(
        fin,
        vec![
            (0, FinishReason::Length, 1),
            (1, FinishReason::Stop(Some(tok(1, 3))), 1)
        ]
    );
    assert!(!s.has_unfinished());
    assert_eq!(s.pool().num_used_pages(), 0);
    assert_eq!(s.schedule().unwrap(), None);
}

#[test]
fn preemption_takes_the_most_recently_admitted_and_keeps_outputs() {
    // 6 pages of 4 tokens; 3 requests of 7-token prompts grow until the pool is short.
    let cfg = SchedulerConfig {
        context_length: 24,
        max_prefill_tokens: 64,
        ..config(6, 4)
    };
    let mut reference = fixed(
        SchedulerConfig {
            num_pages: 64,
            ..cfg.clone()
        },
        2,
    );
    let mut s = fixed(cfg, 2);
    for sched in [&mut s, &mut reference] {
        for i in 0..3 {
            sched
                .add_request(vec![i + 1; 7], 12, vec![], false)
                .unwrap();
        }
    }
    let mut plans = vec![];
    let mut finished = vec![];
    while let Some((plan, out)) = step(&mut s, &mut full) {
        finished.extend(out.finished);
        plans.push(plan);
    }
    let preempted: Vec<Vec<i64>> = plans
        .iter()
        .filter(|p| !p.preempted.is_empty())
        .map(|p| p.preempted.clone())
        .collect();
    assert!(!preempted.is_empty());
    // Requests 0 and 1 are admitted first (2 does not fit); 1, the newer, is preempted first.
    assert_eq!(plans[0].request_ids, vec![0, 1]);
    assert_eq!(preempted[0], vec![1]);
    assert!(s.stats().preemptions >= 1);
    // A resumed request re-prefills prompt + output[..-1] and samples nothing.
    let resume = plans
        .iter()
        .find(|p| {
            p.kind == PlanKind::Prefill
                && p.prefill_done
                    .iter()
                    .zip(&p.sample_first)
                    .any(|(&d, &f)| d == 1 && f == 0)
        })
        .expect("a re-prefill");
    let b = resume
        .prefill_done
        .iter()
        .zip(&resume.sample_first)
        .position(|(&d, &f)| d == 1 && f == 0)
        .unwrap();
    assert!(resume.kv_lens[b] > 7);
    // Outputs equal the run without preemption.
    let mut ref_finished = run_all(&mut reference, &mut full);
    finished.sort_by_key(|f| f.request_id);
    ref_finished.sort_by_key(|f| f.request_id);
    assert_eq!(finished, ref_finished);
    assert_eq!(reference.stats().preemptions, 0);
    assert_eq!(
        s.stats().tokens_generated,
        reference.stats().tokens_generated
    );
}

#[test]
fn preempted_requests_return_to_the_front_in_admission_order() {
    let cfg = SchedulerConfig {
        context_length: 32,
        ..config(8, 4)
    };
    let mut s = fixed(cfg, 0);
    for _ in 0..4 {
        s.add_request(vec![1; 7], 20, vec![], false).unwrap(); // 2 pages each
    }
    s.add_request(vec![1; 3], 20, vec![], false).unwrap();
    // 7 prompt tokens + 1 decode slot = 2 pages each: requests 0..=3 fill the pool, 4 waits.
    step(&mut s, &mut full).unwrap();
    assert_eq!(s.admitted, vec![0, 1, 2, 3]);
    assert_eq!(s.request_state(4), Some(RequestState::Waiting));
    // The second decode needs a third page for everyone: 3, then 2 are preempted.
    let (plan, _) = step(&mut s, &mut full).unwrap();
    assert!(plan.preempted.is_empty());
    let (plan, _) = step(&mut s, &mut full).unwrap();
    assert_eq!(plan.kind, PlanKind::Decode);
    assert_eq!(plan.preempted, vec![3, 2]);
    assert_eq!(plan.request_ids, vec![0, 1]);
    // Back at the front in admission order, before never-admitted 4.
    assert_eq!(s.waiting.iter().copied().collect::<Vec<_>>(), vec![2, 3, 4]);
    assert_eq!(s.stats().queued_preempted, 2);
    assert_eq!(s.num_preemptions_of(2), Some(1));
    assert_eq!(s.output_ids(2).unwrap().len(), 2);
}

#[test]
fn capacity_is_checked_at_the_chosen_steps() {
    // 2 requests fit at steps 0 but not at steps 7: switching steps preempts, never overflows.
    let cfg = SchedulerConfig {
        context_length: 24,
        ..config(6, 4)
    };
    let mut s = fixed(cfg, 0);
    s.add_request(vec![1; 8], 20, vec![], false).unwrap();
    s.add_request(vec![1; 8], 20, vec![], false).unwrap();
    step(&mut s, &mut full).unwrap();
    step(&mut s, &mut full).unwrap();
    // Each holds 9 positions (3 pages): 6 of 6 pages used.
    assert_eq!(s.pool().num_free_pages(), 0);
    s.set_fixed_steps(Some(7)).unwrap();
    let plan = s.schedule().unwrap().unwrap();
    assert_eq!(plan.preempted, vec![1]);
    assert_eq!(plan.request_ids, vec![0]);
    assert_eq!(plan.steps_per_request, vec![7]);
    assert!(s.pool().num_used_pages() <= s.pool().num_pages());
    s.check_invariants().unwrap();
}

#[test]
fn abort_in_every_state_frees_everything() {
    let mut s = fixed(
        SchedulerConfig {
            max_prefill_tokens: 4,
            ..config(64, 4)
        },
        2,
    );
    let running = s.add_request(vec![1; 3], 20, vec![], false).unwrap();
    step(&mut s, &mut full).unwrap();
    let prefilling = s.add_request(vec![1; 10], 20, vec![], false).unwrap();
    let waiting = s.add_request(vec![1; 2], 20, vec![], false).unwrap();
    step(&mut s, &mut full).unwrap();
    assert_eq!(s.request_state(prefilling), Some(RequestState::Prefilling));
    assert_eq!(s.request_state(waiting), Some(RequestState::Waiting));
    let f = s.abort(waiting).unwrap();
    assert_eq!((f.reason, f.output_len), (FinishReason::Abort, 0));
    assert!(s.abort(prefilling).is_some());
    s.check_invariants().unwrap();
    assert_eq!(s.abort(prefilling), None); // twice: harmless
    assert_eq!(s.abort(999), None);
    assert!(s.abort(running).is_some());
    assert_eq!(s.pool().num_used_pages(), 0);
    assert!(!s.has_unfinished());
    assert_eq!(s.stats().requests_aborted, 3);
    s.check_invariants().unwrap();
    assert_eq!(s.schedule().unwrap(), None);
}

#[test]
fn abort_or_finish_while_in_flight_ignores_the_results() {
    let mut s = fixed(config(64, 4), 1);
    let a = s.add_request(vec![1; 3], 20, vec![], false).unwrap();
    let b = s.add_request(vec![1; 3], 20, vec![], false).unwrap();
    let c = s.add_request(vec![1; 3], 20, vec![], false).unwrap();
    // Abort during the prefill in flight.
    let plan = s.schedule().unwrap().unwrap();
    assert!(s.abort(a).is_some());
    let out = s.report(&[5, 6, 7], &[0, 1, 2, 3], None).unwrap();
    assert_eq!(out.request_ids, vec![0, 1, 2]);
    assert_eq!(out.new_offsets, vec![0, 0, 1, 2]);
    assert_eq!(plan.request_ids.len(), 3);
    // Stop string matched during the decode in flight.
    s.schedule().unwrap().unwrap();
    let f = s.finish_request(b, FinishReason::Stop(None)).unwrap();
    assert_eq!((f.reason.as_str(), f.output_len), ("stop", 1));
    let out = s.report(&[8, 9, 8, 9], &[0, 2, 4], None).unwrap();
    assert_eq!(out.new_tokens, vec![8, 9]);
    assert!(out.finished.is_empty());
    assert_eq!(s.output_ids(c).unwrap(), &[7, 8, 9]);
    assert_eq!(s.stats().requests_finished, 1);
    assert_eq!(s.stats().requests_aborted, 1);
    s.check_invariants().unwrap();
}

#[test]
fn plan_and_report_alternate_and_bad_reports_change_nothing() {
    let mut s = fixed(config(64, 4), 2);
    assert_eq!(
        s.report(&[], &[0], None),
        Err(SchedulerError::NoPlanInFlight)
    );
    s.add_request(vec![1; 3], 20, vec![], false).unwrap();
    s.add_request(vec![1; 3], 20, vec![], false).unwrap();
    s.schedule().unwrap().unwrap();
    assert_eq!(s.schedule(), Err(SchedulerError::PlanInFlight));
    let field = |r: Result<ReportOutcome, SchedulerError>| match r {
        Err(SchedulerError::InvalidReport { field, message }) => format!("{field}: {message}"),
        other => panic!("{other:?}"),
    };
    assert!(field(s.report(&[1, 2], &[0, 2], None)).starts_with("offsets: expected 3 entries"));
    assert!(field(s.report(&[1, 2], &[0, 2, 2], None)).contains("request 0 (index 0) has 2 tokens"));
    assert!(field(s.report(&[1, 2], &[0, 1, 3], None))
        .contains("offsets[2] = 3 must equal len(tokens) = 2"));
    assert!(field(s.report(&[1, -2], &[0, 1, 2], None)).starts_with("tokens: tokens[1] = -2"));
    assert!(
        field(s.report(&[1, 2], &[0, 1, 2], Some(&[0, 0]))).starts_with("accepted: must be None")
    );
    assert!(s.plan_in_flight());
    s.report(&[1, 2], &[0, 1, 2], None).unwrap();
    s.schedule().unwrap().unwrap();
    assert!(field(s.report(&[1, 2, 3, 4], &[0, 4, 4], None)).contains("emits 1..=3 tokens"));
    assert!(field(s.report(&[1, 2, 3], &[0, 2, 3], Some(&[0, 0])))
        .starts_with("accepted: accepted[0] = 0 but request 0 emitted 2"));
    assert!(field(s.report(&[1, 2, 3], &[0, 2, 3], Some(&[1])))
        .starts_with("accepted: expected 2 entries"));
    s.check_invariants().unwrap();
    s.report(&[1, 2, 3], &[0, 2, 3], Some(&[1, 0])).unwrap();
    s.check_invariants().unwrap();
}

#[test]
fn admission_keeps_room_for_one_decode_of_everyone() {
    // 8 pages of 4. Request 0 (7 tokens; 2 drafts + 1 at its next decode) may need 1 more page;
    // request 1's 20 prompt tokens plus its first decode need 6: 6 + 1 > 6 free, so it waits.
    let cfg = SchedulerConfig {
        context_length: 32,
        ..config(8, 4)
    };
    let mut s = fixed(cfg, 3);
    s.add_request(vec![1; 7], 4, vec![], false).unwrap();
    step(&mut s, &mut full).unwrap();
    s.add_request(vec![1; 20], 2, vec![], false).unwrap();
    let (plan, out) = step(&mut s, &mut full).unwrap();
    assert_eq!(plan.kind, PlanKind::Decode);
    assert_eq!(s.request_state(1), Some(RequestState::Waiting));
    // Request 0 finished (max_new_tokens 4): now request 1 fits.
    assert_eq!(out.finished.len(), 1);
    let (plan, _) = step(&mut s, &mut full).unwrap();
    assert_eq!((plan.kind, plan.request_ids), (PlanKind::Prefill, vec![1]));
    assert_eq!(s.stats().preemptions, 0);
}

#[test]
fn max_running_requests_bounds_admission() {
    let mut s = fixed(
        SchedulerConfig {
            max_running_requests: 2,
            ..config(64, 4)
        },
        0,
    );
    for _ in 0..3 {
        s.add_request(vec![1; 2], 2, vec![], false).unwrap();
    }
    let (plan, _) = step(&mut s, &mut full).unwrap();
    assert_eq!(plan.request_ids, vec![0, 1]);
    let (plan, _) = step(&mut s, &mut full).unwrap();
    assert_eq!(plan.kind, PlanKind::Decode);
    let (plan, _) = step(&mut s, &mut full).unwrap();
    assert_eq!(plan.request_ids, vec![2]);
}

#[test]
fn the_adaptive_policy_is_fed_uncapped_requests_and_switches() {
    let cfg = AdaptiveConfig::from_json(r#"{"1": {"candidate_steps": [1, 3], "warmup_batches": 0, "update_interval": 1, "ema_alpha": 1.0}}"#).unwrap();
    let params = AdaptiveSpeculativeParams::new(3, cfg);
    let sc = SchedulerConfig {
        record_trace: true,
        max_running_requests: 4,
        ..config(128, 4)
    };
    let mut s = Scheduler::new(sc, StepsSource::Adaptive(params)).unwrap();
    assert_eq!(s.candidate_steps(), vec![1, 3]);
    s.add_request(vec![1; 2], 40, vec![], false).unwrap();
    s.add_request(vec![1; 2], 3, vec![], false).unwrap(); // capped to 1 at the first decode
    step(&mut s, &mut full).unwrap();
    // Request 0 accepts nothing: the EMA falls, steps go down to 1.
    let (plan, _) = step(&mut s, &mut |id, sr| if id == 0 { 0 } else { sr }).unwrap();
    assert_eq!(
        (plan.steps, plan.steps_per_request.clone()),
        (3, vec![3, 1])
    );
    assert_eq!(s.slot_states()[0].1, 1);
    assert_eq!(s.slot_states()[0].3, 1);
    assert_eq!(s.stats().step_switches, 1);
    let (plan, _) = step(&mut s, &mut full).unwrap();
    assert_eq!(plan.steps, 1);
    let trace = s.drain_trace();
    assert_eq!(trace.len(), 2);
    assert_eq!(
        trace[0].to_json(),
        r#"{"accepted":[0,1],"batch_size":2,"context_tokens":4,"steps":3,"steps_per_request":[3,1]}"#
    );
    assert_eq!(
        trace[1].to_json(),
        r#"{"accepted":[1],"batch_size":1,"context_tokens":3,"steps":1}"#
    );
    assert!(s.drain_trace().is_empty());
    let st = s.stats();
    assert_eq!(st.decode_iterations_by_steps, vec![(1, 1), (3, 1)]);
    assert_eq!(
        (
            st.spec_num_drafts,
            st.spec_num_draft_tokens,
            st.spec_num_accepted_tokens
        ),
        (3, 5, 2)
    );
    assert_eq!(st.spec_accepted_per_pos, vec![2, 0, 0]);
    // Fixed steps override the policy, which is then not fed.
    s.set_fixed_steps(Some(0)).unwrap();
    step(&mut s, &mut full).unwrap();
    assert_eq!(s.slot_states()[0].3, 2);
    assert!(Scheduler::new(config(8, 8), StepsSource::Fixed(1))
        .unwrap()
        .set_fixed_steps(None)
        .is_err());
    s.set_fixed_steps(None).unwrap();
    assert_eq!(s.fixed_steps(), None);
}

#[test]
fn steps_zero_feeds_every_request() {
    let cfg = AdaptiveConfig::from_json(
        r#"{"1": {"candidate_steps": [0, 2], "warmup_batches": 0, "update_interval": 2}}"#,
    )
    .unwrap();
    let mut s = Scheduler::new(
        config(64, 4),
        StepsSource::Adaptive(AdaptiveSpeculativeParams::new(0, cfg)),
    )
    .unwrap();
    s.add_request(vec![1; 2], 40, vec![], false).unwrap();
    step(&mut s, &mut full).unwrap();
    let (p1, _) = step(&mut s, &mut full).unwrap();
    let (p2, _) = step(&mut s, &mut full).unwrap();
    let (p3, _) = step(&mut s, &mut full).unwrap();
    // Two verifies at steps 0 make the slot probe steps 2.
    assert_eq!((p1.steps, p2.steps, p3.steps), (0, 0, 2));
    assert_eq!(s.stats().step_switches, 1);
}

#[test]
fn graph_batch_size_is_padded() {
    let mut s = fixed(config(64, 4), 1);
    assert!(s
        .set_cuda_graph_bs(Some(&[0]))
        .unwrap_err()
        .to_string()
        .starts_with("cuda_graph_bs: cuda_graph_bs[0] = 0"));
    s.set_cuda_graph_bs(Some(&[4, 1, 2])).unwrap();
    assert_eq!(s.cuda_graph_bs(), Some(&[1, 2, 4][..]));
    for _ in 0..3 {
        s.add_request(vec![1; 2], 10, vec![], false).unwrap();
    }
    step(&mut s, &mut full).unwrap();
    let (plan, _) = step(&mut s, &mut full).unwrap();
    assert_eq!((plan.graph_bs, plan.graph_key()), (Some(4), GraphKey::Chain(1, 4)));
    s.set_cuda_graph_bs(Some(&[2])).unwrap();
    let (plan, _) = step(&mut s, &mut full).unwrap();
    assert_eq!((plan.graph_bs, plan.graph_key()), (None, GraphKey::Chain(1, 3)));
}

#[test]
fn stats_count_requests_and_tokens() {
    let mut s = fixed(config(64, 4), 2);
    for _ in 0..3 {
        s.add_request(vec![1; 5], 6, vec![], false).unwrap();
    }
    let finished = run_all(&mut s, &mut full);
    assert_eq!(finished.len(), 3);
    assert!(finished
        .iter()
        .all(|f| f.reason == FinishReason::Length && f.output_len == 6));
    let st = s.stats();
    assert_eq!(
        (st.requests_added, st.requests_finished, st.tokens_generated),
        (3, 3, 18)
    );
    assert_eq!(
        (st.running, st.queued, st.kv_pages_used, st.kv_pages_total),
        (0, 0, 0, 64)
    );
    assert_eq!(st.prefill_iterations, 1);
    // 5 tokens after the first: steps 2 emits 3, then capped to 1 emits 2.
    assert_eq!(st.decode_iterations, 2);
}

#[test]
fn short_pages_run_fewer_steps_before_any_preemption() {
    // Two requests of 8 prompt tokens in 6 pages of 4 slots. The first decode (steps 3) accepts
    // nothing: each then holds positions 0..=8 in 3 pages, no page is free. Steps 3 would need
    // position 12 (a 4th page each); the slot's lower candidate 2 fits in the pages held.
    let cfg = AdaptiveConfig::from_json(r#"{"1": {"candidate_steps": [0, 2, 3], "warmup_batches": 100}}"#).unwrap();
    let params = AdaptiveSpeculativeParams::new(3, cfg);
    let sc = SchedulerConfig { record_trace: true, context_length: 24, ..config(6, 4) };
    let mut s = Scheduler::new(sc, StepsSource::Adaptive(params)).unwrap();
    s.add_request(vec![1; 8], 20, vec![], false).unwrap();
    s.add_request(vec![1; 8], 20, vec![], false).unwrap();
    step(&mut s, &mut full).unwrap(); // prefill
    let (plan, _) = step(&mut s, &mut |_, _| 0).unwrap();
    assert_eq!(plan.steps, 3);
    assert_eq!(s.pool().num_free_pages(), 0);
    let (plan, _) = step(&mut s, &mut |_, _| 0).unwrap();
    assert_eq!((plan.kind, plan.steps, plan.batch_size()), (PlanKind::Decode, 2, 2));
    assert!(plan.preempted.is_empty());
    assert_eq!(s.stats().preemptions, 0);
    // The trace records the steps actually run; the ema slot (at 3) was not fed a depth-2 verify.
    let trace = s.drain_trace();
    assert_eq!(trace[1].steps, 2);
    assert_eq!(s.slot_states()[0].3, 1);
}

#[test]
fn rows_are_taken_at_admission_and_given_back() {
    let mut s = fixed(config(64, 4), 1);
    for i in 0..3 {
        s.add_request(vec![i + 1; 3], 8, vec![], false).unwrap();
    }
    let (plan, _) = step(&mut s, &mut full).unwrap();
    // the lowest rows first, in admission order; the plan carries them
    assert_eq!(plan.rows, vec![0, 1, 2]);
    assert_eq!((s.row_of(1), s.rows_in_use()), (Some(1), 3));
    // without plan_kv_layout, no per-token context arrays
    assert!(plan.kv_indices.is_empty() && plan.page_table.is_empty());
    assert!(plan.page_table_offsets.is_empty());
    let (plan, _) = step(&mut s, &mut full).unwrap();
    assert_eq!((plan.kind, plan.rows.clone()), (PlanKind::Decode, vec![0, 1, 2]));
    // an abort gives its row back; the next admission takes the most recently freed row
    s.abort(1).unwrap();
    assert_eq!((s.row_of(1), s.rows_in_use()), (None, 2));
    s.add_request(vec![9; 3], 2, vec![], false).unwrap();
    let (plan, _) = step(&mut s, &mut full).unwrap();
    assert_eq!((plan.request_ids.clone(), plan.rows.clone()), (vec![3], vec![1]));
    run_all(&mut s, &mut full);
    assert_eq!(s.rows_in_use(), 0);
    s.check_invariants().unwrap();
}

#[test]
fn preemption_frees_the_row_and_the_restart_takes_one_again() {
    let cfg = SchedulerConfig {
        context_length: 24,
        ..config(6, 4)
    };
    let mut s = fixed(cfg, 2);
    for i in 0..3 {
        s.add_request(vec![i + 1; 7], 12, vec![], false).unwrap();
    }
    // 24 tokens of KV for three requests that each grow to 19: decode must preempt
    let (mut saw_preemption, mut finished) = (false, vec![]);
    for _ in 0..10_000 {
        let Some((plan, out)) = step(&mut s, &mut full) else {
            break;
        };
        for &id in &plan.preempted {
            saw_preemption = true;
            assert_eq!(s.row_of(id as u64), None, "a preempted request holds no row");
        }
        let mut rows = plan.rows.clone();
        rows.sort_unstable();
        rows.dedup();
        assert_eq!(rows.len(), plan.batch_size(), "rows are distinct within a plan");
        finished.extend(out.finished);
    }
    assert!(saw_preemption, "the workload must force a preemption");
    // each preempted request restarted, took a row again and finished
    assert_eq!(finished.len(), 3);
    assert_eq!(s.rows_in_use(), 0);
    assert_eq!(s.pool().num_used_pages(), 0);
}

#[test]
fn abandon_plan_aborts_the_live_requests_of_the_plan() {
    let mut s = fixed(config(64, 4), 2);
    for i in 0..3 {
        s.add_request(vec![i + 1; 5], 8, vec![], false).unwrap();
    }
    assert_eq!(s.abandon_plan(), Err(SchedulerError::NoPlanInFlight));
    step(&mut s, &mut full).unwrap();
    let plan = s.schedule().unwrap().unwrap();
    assert_eq!(plan.kind, PlanKind::Decode);
    s.abort(1).unwrap(); // already gone: not in the abandon list
    let finished = s.abandon_plan().unwrap();
    assert_eq!(
        finished.iter().map(|f| (f.request_id, f.reason)).collect::<Vec<_>>(),
        vec![(0, FinishReason::Abort), (2, FinishReason::Abort)]
    );
    assert!(!s.plan_in_flight() && !s.has_unfinished());
    assert_eq!((s.pool().num_used_pages(), s.rows_in_use()), (0, 0));
    assert_eq!(s.stats().requests_aborted, 3);
    s.check_invariants().unwrap();
    assert!(s.schedule().unwrap().is_none());
}

#[test]
fn report_returns_the_stats_and_slot_states_after_it() {
    let mut s = fixed(config(64, 4), 1);
    s.add_request(vec![3; 4], 3, vec![], false).unwrap();
    let (_, out) = step(&mut s, &mut full).unwrap();
    assert_eq!(out.stats, s.stats());
    assert_eq!(out.slot_states, s.slot_states());
    let (_, out) = step(&mut s, &mut full).unwrap();
    assert_eq!((out.stats.running, out.stats.decode_iterations), (0, 1));
    assert_eq!(out.stats, s.stats());
}

#[test]
fn chunked_prefill_size_caps_one_requests_chunk_within_the_budget() {
    // SGLang's chunked_prefill_size (4) apart from the batch budget max_prefill_tokens (64):
    // a 10-token prompt is prefilled 4 + 4 + 2 although the budget has room, one partial
    // request at a time; the next prompt joins the iteration that finishes it.
    let mut s = fixed(
        SchedulerConfig {
            chunked_prefill_size: Some(4),
            ..config(64, 4)
        },
        0,
    );
    s.add_request(vec![1; 10], 4, vec![], false).unwrap();
    s.add_request(vec![2; 3], 4, vec![], false).unwrap();
    let mut lens = Vec::new();
    for _ in 0..3 {
        let (plan, _) = step(&mut s, &mut full).unwrap();
        assert_eq!(plan.kind, PlanKind::Prefill);
        lens.push((plan.request_ids.clone(), plan.qo_lens.clone()));
        s.check_invariants().unwrap();
    }
    assert_eq!(
        lens,
        vec![(vec![0], vec![4]), (vec![0], vec![4]), (vec![0, 1], vec![2, 3])]
    );
    let err = Scheduler::new(
        SchedulerConfig {
            chunked_prefill_size: Some(0),
            ..config(8, 8)
        },
        StepsSource::Fixed(0),
    )
    .unwrap_err()
    .to_string();
    assert!(err.starts_with("chunked_prefill_size: must be >= 1"), "{err}");
}
