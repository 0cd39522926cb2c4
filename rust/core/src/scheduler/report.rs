//! `report`: checking an iteration's results against its plan and applying them.

use crate::config::VerifyMode;
use crate::policy::Observation;
use crate::strategies::RequestVerify;

use super::{
    FinishReason, InFlight, PlanKind, ReportOutcome, RequestState, Scheduler,
    SchedulerError, TraceRecord,
};

/// What a report carries besides the tokens ([`Scheduler::report_with`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct ReportExtras<'a> {
    /// The decode iteration's measured wall time, seconds (finite, > 0; decode plans only).
    pub seconds: Option<f64>,
    /// Requests of the plan whose stop string the caller found in the text of the tokens they
    /// emitted now (the caller detokenizes; the core has no text), as `(request id, keep)`:
    /// `keep` (1 ..= the tokens it emitted) is how many of its emitted tokens to keep, up to and
    /// including the token whose text completed the stop string. The tokens after it are dropped
    /// before the core's own rules (EOS, stop token, length) run on the kept ones, so the
    /// request's output, its usage and the KV it frees are those of plain decoding, one token
    /// per iteration, whatever the speculative depth (vLLM's multi-step output processor appends
    /// a multi-token step one token at a time and stops at the first that finishes). It finishes
    /// with reason `stop` and no stop token unless those rules finish it first, at or before
    /// `keep`. The policy still sees every token the verify accepted: a stop is no rejection.
    pub stop_strings: &'a [(u64, usize)],
    /// Decode only, optional (issue 28): the drafter's probability of each draft token the plan
    /// verified, request after request in plan order (`sum(steps_per_request)` values, each
    /// finite in `[0, 1]`). The `goodput` strategy with `verify = per_request` takes them as the
    /// next decision's draft confidence; other strategies do not use them.
    /// A draft tree's (issue 29 item 5): per request, the path confidence (cumulative draft
    /// probability) of each node it verified, its accepted path's `accepted` nodes first in
    /// depth order, then its other verified nodes (`sum(verified)` values, `N` per request
    /// without `verified`); the confidence calibration learns from them which nodes of each
    /// confidence were accepted.
    pub draft_probs: Option<&'a [f64]>,
    /// Decode only, optional (issue 28's confidence stop): the draft tokens each request
    /// verified, `0 <= verified[b] <= steps_per_request[b]` and `accepted[b] <= verified[b]`
    /// (`None`: `steps_per_request`). Acceptance statistics, the policy's feedback and the trace
    /// count only verified positions; `draft_probs` still holds every drafted one.
    pub verified: Option<&'a [i64]>,
}

/// Checks `verified` against the plan in flight and the emitted counts (see
/// [`ReportExtras::verified`]).
fn validate_verified(fl: &InFlight, offsets: &[i64], verified: Option<&[i64]>) -> Result<(), SchedulerError> {
    let Some(v) = verified else { return Ok(()) };
    if fl.kind == PlanKind::Prefill {
        return Err(bad("verified", "is reported for decode plans only".into()));
    }
    if v.len() != fl.ids.len() {
        return Err(bad("verified", format!("expected {} entries (one per request), got {}", fl.ids.len(), v.len())));
    }
    for (i, &n) in v.iter().enumerate() {
        // a draft tree's verified count is its kept nodes (issue 29 item 5): up to N
        let most = i64::from(fl.tree.map_or(fl.steps_r[i], |t| t.num_draft_tokens));
        let accepted = offsets[i + 1] - offsets[i] - 1;
        if !(0..=most).contains(&n) {
            return Err(bad("verified", format!("verified[{i}] = {n} must be in 0..={most} (steps_per_request[{i}])")));
        }
        if accepted > n {
            return Err(bad("verified", format!("verified[{i}] = {n} is below the {accepted} drafts request {} accepted", fl.ids[i])));
        }
    }
    Ok(())
}

/// Checks `draft_probs` against the plan in flight (see [`ReportExtras::draft_probs`]).
/// `verified`: the report's (checked before).
fn validate_draft_probs(fl: &InFlight, probs: Option<&[f64]>, verified: Option<&[i64]>) -> Result<(), SchedulerError> {
    let Some(q) = probs else { return Ok(()) };
    if fl.kind == PlanKind::Prefill {
        return Err(bad("draft_probs", "is reported for decode plans only".into()));
    }
    if let Some(t) = fl.tree {
        let want: usize = verified.map_or(fl.ids.len() * t.num_draft_tokens as usize, |v| v.iter().map(|&n| n as usize).sum());
        if q.len() != want {
            return Err(bad("draft_probs", format!("of a draft tree must hold sum(verified) = {want} path confidences (one per verified node), got {}", q.len())));
        }
    }
    let want: usize = fl.steps_r.iter().map(|&s| s as usize).sum();
    if fl.tree.is_none() && q.len() != want {
        return Err(bad("draft_probs", format!("must hold sum(steps_per_request) = {want} probabilities (one per verified draft token), got {}", q.len())));
    }
    if let Some(i) = q.iter().position(|p| !(0.0..=1.0).contains(p)) {
        return Err(bad("draft_probs", format!("draft_probs[{i}] = {} is not a probability in [0, 1]", q[i])));
    }
    Ok(())
}

fn bad(field: &'static str, message: String) -> SchedulerError {
    SchedulerError::InvalidReport { field, message }
}

/// Checks `tokens` / `offsets` / `accepted` against the plan in flight.
fn validate(
    fl: &InFlight,
    tokens: &[i64],
    offsets: &[i64],
    accepted: Option<&[i64]>,
    stop_strings: &[(u64, usize)],
) -> Result<(), SchedulerError> {
    let b = fl.ids.len();
    if offsets.len() != b + 1 {
        return Err(bad(
            "offsets",
            format!(
                "expected {} entries (one per request of the plan plus one), got {}",
                b + 1,
                offsets.len()
            ),
        ));
    }
    if offsets[0] != 0 {
        return Err(bad(
            "offsets",
            format!("offsets[0] must be 0, got {}", offsets[0]),
        ));
    }
    if offsets[b] != tokens.len() as i64 {
        return Err(bad(
            "offsets",
            format!(
                "offsets[{b}] = {} must equal len(tokens) = {}",
                offsets[b],
                tokens.len()
            ),
        ));
    }
    for i in 0..b {
        let n = offsets[i + 1] - offsets[i];
        let id = fl.ids[i];
        let allowed = match fl.kind {
            PlanKind::Prefill => {
                let s = i64::from(fl.sample[i]);
                (n == s).then_some(()).ok_or_else(|| {
                    format!(
                        "a prefill chunk emits {s} token(s) for this request (sample_first = {s})"
                    )
                })
            }
            PlanKind::Decode => {
                let max = i64::from(fl.steps_r[i]) + 1;
                (1..=max).contains(&n).then_some(()).ok_or_else(|| {
                    format!(
                        "a decode iteration emits 1..={max} tokens for it (steps_per_request + 1)"
                    )
                })
            }
        };
        if let Err(rule) = allowed {
            return Err(bad(
                "offsets",
                format!(
                    "request {id} (index {i}) has {n} tokens in offsets[{i}..{}]; {rule}",
                    i + 2
                ),
            ));
        }
    }
    for (j, &(id, keep)) in stop_strings.iter().enumerate() {
        let Some(i) = fl.ids.iter().position(|&x| x == id) else {
            return Err(bad("stop_strings", format!("request {id} is not in the plan in flight")));
        };
        let n = (offsets[i + 1] - offsets[i]) as usize;
        if n == 0 {
            return Err(bad(
                "stop_strings",
                format!("request {id} emitted no token in this plan, so no stop string can match"),
            ));
        }
        if !(1..=n).contains(&keep) {
            return Err(bad(
                "stop_strings",
                format!("request {id} keeps {keep} tokens; must be 1..={n} (the tokens it emitted in this plan, up to the one that completed the stop string)"),
            ));
        }
        if stop_strings[..j].iter().any(|&(x, _)| x == id) {
            return Err(bad("stop_strings", format!("request {id} is listed twice")));
        }
    }
    if let Some((i, &t)) = tokens.iter().enumerate().find(|(_, &t)| t < 0) {
        return Err(bad(
            "tokens",
            format!("tokens[{i}] = {t}: token ids must be >= 0"),
        ));
    }
    match (fl.kind, accepted) {
        (_, None) => {}
        (PlanKind::Prefill, Some([])) => {}
        (PlanKind::Prefill, Some(_)) => {
            return Err(bad(
                "accepted",
                "must be None for a prefill plan (no drafts are verified)".into(),
            ));
        }
        (PlanKind::Decode, Some(a)) => {
            if a.len() != b {
                return Err(bad(
                    "accepted",
                    format!("expected {b} entries (one per request), got {}", a.len()),
                ));
            }
            for i in 0..b {
                let n = offsets[i + 1] - offsets[i];
                if a[i] != n - 1 {
                    return Err(bad(
                        "accepted",
                        format!(
                            "accepted[{i}] = {} but request {} emitted {n} tokens (accepted drafts + 1 bonus)",
                            a[i], fl.ids[i]
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

impl Scheduler {
    /// Applies the results of the plan in flight; the outcome also carries the stats and slot
    /// states after it (what a serving loop reads next, so it need not ask again).
    ///
    /// - `tokens`: emitted tokens, request after request in plan order; request `b` emitted
    ///   `tokens[offsets[b] .. offsets[b + 1]]` (`offsets` has `B + 1` entries, from 0).
    ///   Prefill: one token (the first sampled) for requests with `sample_first`, none for the
    ///   others. Decode: `accepted_b + 1` tokens (the accepted drafts, then the bonus token),
    ///   `accepted_b <= steps_per_request[b]`.
    /// - `accepted`: decode only, optional: accepted drafts per request; must equal the counts
    ///   implied by `offsets` minus one. `None` derives it.
    ///
    /// Feeds the policy (decode), appends tokens with the stop rules, frees rejected slots and
    /// finished requests. Results for requests aborted or finished while the plan was in flight
    /// are ignored.
    ///
    /// Errors (the plan stays in flight, nothing changes): [`SchedulerError::NoPlanInFlight`],
    /// [`SchedulerError::InvalidReport`] naming `offsets`, `tokens` or `accepted`.
    pub fn report(
        &mut self,
        tokens: &[i64],
        offsets: &[i64],
        accepted: Option<&[i64]>,
    ) -> Result<ReportOutcome, SchedulerError> {
        self.report_timed(tokens, offsets, accepted, None)
    }

    /// [`Scheduler::report`] with the decode iteration's measured wall time, `seconds` (finite,
    /// > 0; decode plans only), which the policy is fed with the batch's context tokens and the
    /// steps the plan ran (the `goodput` strategy learns its cost model from them).
    ///
    /// Errors: those of `report`, and [`SchedulerError::InvalidReport`] naming `seconds`.
    pub fn report_timed(
        &mut self,
        tokens: &[i64],
        offsets: &[i64],
        accepted: Option<&[i64]>,
        seconds: Option<f64>,
    ) -> Result<ReportOutcome, SchedulerError> {
        self.report_with(tokens, offsets, accepted, ReportExtras { seconds, ..Default::default() })
    }

    /// [`Scheduler::report`] with everything the caller knows of the iteration
    /// ([`ReportExtras`]): its seconds, and the requests a stop string finished with the tokens
    /// they keep, so every finish is decided here, in one place, and the caller never calls back
    /// after the report.
    ///
    /// Errors: those of `report_timed`, and [`SchedulerError::InvalidReport`] naming
    /// `stop_strings` for an id not in the plan, one that emitted no token, a `keep` outside
    /// `1..=` its emitted tokens, or an id listed twice.
    pub fn report_with(
        &mut self,
        tokens: &[i64],
        offsets: &[i64],
        accepted: Option<&[i64]>,
        extras: ReportExtras<'_>,
    ) -> Result<ReportOutcome, SchedulerError> {
        let ReportExtras { seconds, stop_strings, draft_probs, verified } = extras;
        let fl = self
            .in_flight
            .as_ref()
            .ok_or(SchedulerError::NoPlanInFlight)?;
        validate(fl, tokens, offsets, accepted, stop_strings)?;
        validate_verified(fl, offsets, verified)?;
        validate_draft_probs(fl, draft_probs, verified)?;
        if let Some(t) = seconds {
            if fl.kind == PlanKind::Prefill {
                return Err(bad("seconds", "is reported for decode plans only".into()));
            }
            if !(t.is_finite() && t > 0.0) {
                return Err(bad("seconds", format!("must be a finite number > 0 (the iteration's wall time), got {t}")));
            }
        }
        let fl = self.in_flight.take().expect("checked above");
        self.release_scratch(); // a tree's scratch slots (scheduler/tree.rs)
        if fl.kind == PlanKind::Decode {
            // Unreported: a chain verified its `steps_per_request`, a draft tree all its `N`
            // nodes (not its depth: the tree planner's token-cost fit learns the verify tokens
            // from these counts, and with the depth it learned 0 extra verify tokens per tree,
            // so its seconds per verify token stayed at the prior and "auto" never cut a node)
            let verified: Vec<u32> = match (verified, fl.tree) {
                (Some(v), _) => v.iter().map(|&n| n as u32).collect(),
                (None, Some(t)) => vec![t.num_draft_tokens; fl.ids.len()],
                (None, None) => fl.steps_r.clone(),
            };
            self.observe_verify(&fl, offsets, seconds, draft_probs, &verified);
        }
        let ctx = u64::from(self.config.context_length);
        let b = fl.ids.len();
        let mut out = ReportOutcome {
            request_ids: fl.ids.iter().map(|&id| id as i64).collect(),
            new_tokens: Vec::with_capacity(tokens.len()),
            new_offsets: Vec::with_capacity(b + 1),
            finished: Vec::new(),
            stats: Default::default(),
            slot_states: Vec::new(),
        };
        out.new_offsets.push(0);
        for i in 0..b {
            let id = fl.ids[i];
            let mut emitted = &tokens[offsets[i] as usize..offsets[i + 1] as usize];
            // a stop string completed at emitted[keep - 1]: the tokens after it are not output
            let stop_string = stop_strings.iter().find(|&&(x, _)| x == id);
            if let Some(&(_, keep)) = stop_string {
                emitted = &emitted[..keep];
            }
            if let Some(r) = self.requests.get_mut(&id) {
                let mut finish = None;
                // KV positions holding accepted tokens (what the prefix cache may take)
                let committed;
                match fl.kind {
                    PlanKind::Prefill => {
                        committed = r.kv_len;
                        if fl.done[i] {
                            debug_assert_eq!(r.state, RequestState::Prefilling);
                            r.state = RequestState::Running;
                            self.num_running += 1;
                            if fl.sample[i] {
                                let (n, f) = r.append(emitted, &self.config.eos_token_ids, ctx);
                                out.new_tokens.extend_from_slice(&emitted[..n]);
                                finish = f;
                            }
                        }
                    }
                    PlanKind::Decode => {
                        // A drafting iteration catches the drafter up; a skipped extend (the plan
                        // marks it: budget 0 with the zero-step extend skipped, so every request
                        // of a steps-0 iteration) leaves it behind by what was emitted.
                        let skipped = fl.skip[i];
                        if skipped {
                            r.draft_lag += emitted.len() as u64;
                        } else {
                            r.draft_lag = 0;
                        }
                        // Positions L ..= L + steps_r were reserved; keep L ..= L + accepted.
                        let base = r.kv_len - (u64::from(fl.steps_r[i]) + 1);
                        let (n, f) = r.append(emitted, &self.config.eos_token_ids, ctx);
                        out.new_tokens.extend_from_slice(&emitted[..n]);
                        finish = f;
                        // the verify slots past the accepted tokens are never committed
                        committed = (base + emitted.len() as u64).min(r.tokens.len() as u64 - 1);
                        if finish.is_none() {
                            let keep = base + emitted.len() as u64;
                            self.pool
                                .truncate(id, keep)
                                .expect("keep <= reserved length");
                            r.kv_len = keep;
                        }
                    }
                }
                if finish.is_none() && stop_string.is_some() {
                    finish = Some(FinishReason::Stop(None));
                }
                self.cache_committed(id, committed);
                if let Some(reason) = finish {
                    let r = self.requests.remove(&id).expect("present");
                    self.pool
                        .free_request(id)
                        .expect("admitted request has a page table");
                    self.free_rows
                        .push(r.row.expect("an admitted request holds a row"));
                    self.num_running -= 1;
                    self.count_finish(reason);
                    out.finished.push(r.finished(id, reason));
                }
            }
            out.new_offsets.push(out.new_tokens.len() as i64);
        }
        self.counters.tokens_generated += out.new_tokens.len() as u64;
        if !out.finished.is_empty() {
            let requests = &self.requests;
            self.admitted.retain(|id| requests.contains_key(id));
        }
        if fl.kind == PlanKind::Decode {
            self.counters.decode_iterations += 1;
            self.last_decode_steps = Some(fl.steps);
        }
        out.stats = self.stats();
        out.slot_states = self.slot_states();
        Ok(out)
    }

    /// Policy feedback, speculation counters and the trace record of one verify.
    /// `verified[b]`: draft tokens request `b` verified (its `steps_per_request` unless the
    /// confidence stop cut it).
    fn observe_verify(&mut self, fl: &InFlight, offsets: &[i64], seconds: Option<f64>, draft_probs: Option<&[f64]>, verified: &[u32]) {
        let b = fl.ids.len();
        let accepted = |i: usize| offsets[i + 1] - offsets[i] - 1;
        let steps = fl.steps;
        let per_request = self.policy.as_ref().and_then(|p| p.goodput()).is_some_and(|g| g.verify_mode() == VerifyMode::PerRequest);
        if fl.from_policy && per_request {
            let p = self.policy.as_mut().expect("checked above");
            let mut at = 0usize;
            let requests: Vec<RequestVerify<'_>> = (0..b)
                .map(|i| {
                    // a chain's probabilities cover its drafts, a tree's its verified nodes
                    let n = if fl.tree.is_some() { verified[i] } else { fl.steps_r[i] } as usize;
                    at += n;
                    // the policy learns from the positions verified (the cut ones have no outcome)
                    let probs = draft_probs.map(|q| &q[at - n..at - n + (verified[i] as usize).min(n)]);
                    RequestVerify { id: fl.ids[i], steps: verified[i], accepted: accepted(i), draft_probs: probs }
                })
                .collect();
            let obs = Observation { seconds, context_tokens: Some(fl.context), steps: Some(steps), catch_up_tokens: Some(fl.catch_up) };
            let changed = p.on_verify_complete_requests(&requests, obs).expect("the report was validated");
            if changed.is_some() {
                self.counters.step_switches += 1;
            }
        } else if fl.from_policy {
            if let Some(p) = &mut self.policy {
                let fed = (0..b).filter(|&i| verified[i] == steps).map(accepted);
                let obs = Observation {
                    seconds,
                    context_tokens: Some(fl.context),
                    steps: Some(steps),
                    catch_up_tokens: Some(fl.catch_up),
                };
                let changed = p
                    .on_verify_complete_with(fed, b as i64, obs)
                    .expect("accepted counts and seconds were validated");
                if changed.is_some() {
                    self.counters.step_switches += 1;
                }
            }
        }
        let c = &mut self.counters;
        if c.by_steps.len() <= steps as usize {
            c.by_steps.resize(steps as usize + 1, 0);
        }
        c.by_steps[steps as usize] += 1;
        for i in 0..b {
            let sr = verified[i];
            if sr == 0 {
                continue;
            }
            let a = accepted(i) as usize;
            c.spec_num_drafts += 1;
            c.spec_num_draft_tokens += u64::from(sr);
            c.spec_num_accepted_tokens += a as u64;
            // positions are depths: a tree's kept nodes (up to N) are not positions
            let positions = sr.min(steps) as usize;
            if c.spec_accepted_per_pos.len() < positions {
                c.spec_accepted_per_pos.resize(positions, 0);
            }
            for slot in &mut c.spec_accepted_per_pos[..a] {
                *slot += 1;
            }
        }
        if self.config.record_trace {
            let capped = fl.steps_r.iter().any(|&s| s != steps);
            let stop = fl.min_survival > 0.0;
            self.trace.push(TraceRecord {
                batch_size: b as u32,
                steps,
                accepted: (0..b).map(accepted).collect(),
                steps_per_request: capped
                    .then(|| fl.steps_r.iter().map(|&s| i64::from(s)).collect()),
                min_survival: stop.then_some(fl.min_survival),
                verified: stop.then(|| verified.iter().map(|&s| i64::from(s)).collect()),
                context_tokens: fl.context,
                seconds,
                predicted_seconds: fl.predicted,
                tree: fl.tree.map(|t| (t.topk, t.num_draft_tokens)),
            });
        }
    }
}
