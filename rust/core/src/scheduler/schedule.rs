//! `schedule`: choosing and building the next iteration's plan (prefill or decode), admission
//! and preemption.

use super::{InFlight, Plan, PlanKind, RequestState, Scheduler, SchedulerError};
use crate::config::VerifyMode;
use crate::prefix_cache::ROOT;
use crate::decision::{TreeShape, VerifyShape};

/// Per-plan array builder shared by prefill and decode.
#[derive(Default)]
struct Arrays {
    request_ids: Vec<i64>,
    rows: Vec<i64>,
    input_ids: Vec<i64>,
    positions: Vec<i64>,
    out_loc: Vec<i64>,
    qo_lens: Vec<i64>,
    kv_lens: Vec<i64>,
    kv_indices: Vec<i64>,
    page_table: Vec<i64>,
    page_table_offsets: Vec<i64>,
    cached_lens: Vec<i64>,
    cached_draft_lens: Vec<i64>,
    cached_kv_indices: Vec<i64>,
    cached_ids: Vec<i64>,
}

impl Arrays {
    /// `n_kv`: context slots, when the plan carries the KV layout (`None`: it does not).
    fn with_capacity(b: usize, n_tokens: usize, n_inputs: usize, n_kv: Option<usize>) -> Self {
        let mut page_table_offsets = Vec::new();
        if n_kv.is_some() {
            page_table_offsets.reserve(b + 1);
            page_table_offsets.push(0);
        }
        let n_kv = n_kv.unwrap_or(0);
        Arrays {
            request_ids: Vec::with_capacity(b),
            rows: Vec::with_capacity(b),
            input_ids: Vec::with_capacity(n_inputs),
            positions: Vec::with_capacity(n_inputs),
            out_loc: Vec::with_capacity(n_tokens),
            qo_lens: Vec::with_capacity(b),
            kv_lens: Vec::with_capacity(b),
            kv_indices: Vec::with_capacity(n_kv),
            page_table: Vec::new(),
            page_table_offsets,
            cached_lens: Vec::new(),
            cached_draft_lens: Vec::new(),
            cached_kv_indices: Vec::new(),
            cached_ids: Vec::new(),
        }
    }
}

impl Scheduler {
    /// The next iteration's plan, or `None` when there is nothing to run (no request, or only
    /// waiting ones that cannot be admitted, which the config rules out).
    ///
    /// Prefill when something can be prefilled, except that after a prefill plan that left a
    /// prompt unfinished a decode plan comes first (if any request is running). A decode plan
    /// preempts the most recently admitted requests until the pages its steps need are free.
    /// Reserves the KV slots the plan writes.
    ///
    /// Errors: [`SchedulerError::PlanInFlight`] while the previous plan awaits its report.
    pub fn schedule(&mut self) -> Result<Option<Plan>, SchedulerError> {
        if self.in_flight.is_some() {
            return Err(SchedulerError::PlanInFlight);
        }
        let decode_first = std::mem::take(&mut self.decode_turn) && self.num_running > 0;
        if !decode_first {
            if let Some(plan) = self.schedule_prefill() {
                return Ok(Some(plan));
            }
        }
        Ok(self.schedule_decode())
    }

    /// Largest steps a decode plan can choose now (for admission's page reserve).
    pub(super) fn max_steps(&self) -> u32 {
        match (self.fixed_steps, &self.policy) {
            (Some(k), _) => k,
            (None, Some(p)) => p.candidate_steps().last().copied().unwrap_or(0),
            (None, None) => 0,
        }
    }

    /// `(steps, per-request verify lengths, padded graph batch size, lower steps to fall back to
    /// when pages run short (as chains), the draft tree, the confidence stop's `min_survival` or 0)` for a decode batch of `b >= 1` requests with `context` tokens of
    /// context and `catch_up` drafter catch-up tokens pending. Asks the policy's `decide` (which
    /// records the steps as its pending decision) unless fixed steps are in force (then every
    /// request runs them, as the configured tree when there is one).
    fn decide(&mut self, b: usize, context: u64, catch_up: u64) -> (u32, VerifyShape, Option<u32>, Vec<u32>, Option<TreeShape>, f32) {
        let graph = self
            .graph_bs
            .as_ref()
            .and_then(|g| g.get(g.partition_point(|&s| (s as usize) < b)).copied());
        match (self.fixed_steps, &mut self.policy) {
            (Some(k), _) => (k, VerifyShape::Uniform, graph, Vec::new(), self.tree.and_then(|t| t.at_depth(k)), 0.0),
            (None, Some(p)) => {
                // A per-request decision keys each request's history by its id (batch order:
                // the running requests in admission order, as `decode_batch` lays them out).
                let per_request = p.goodput().is_some_and(|g| g.verify_mode() == VerifyMode::PerRequest);
                let ids: Option<Vec<u64>> = per_request.then(|| {
                    let requests = &self.requests;
                    self.admitted.iter().copied().filter(|id| requests[id].state == RequestState::Running).collect()
                });
                let d = p
                    .decide_requests(b as i64, Some(context), Some(catch_up), ids.as_deref())
                    .expect("decode batch size is >= 1");
                let lower = p.config().slots[d.slot]
                    .1
                    .candidate_steps
                    .iter()
                    .rev()
                    .copied()
                    .filter(|&k| k < d.steps)
                    .collect();
                // A strategy's tree (issue 29, H4's entry): `Decision { tree: Some(..) }` with
                // `steps == depth`, within the configured tree (admission reserved for its N).
                let tree = d.tree.filter(|_| d.steps > 0);
                debug_assert!(tree.map_or(true, |t| t.depth == d.steps
                    && self.tree.is_some_and(|c| t.topk <= c.topk && t.num_draft_tokens <= c.num_draft_tokens)));
                // The confidence stop cuts a chain's verify; on a tree (per-request budgets, issue
                // 29 item 5) it keeps the nodes whose path confidence reaches it.
                let stop = d.confidence_stop.map_or(0.0, |c| c.min_survival);
                (d.steps, d.verify, graph, lower, tree, stop)
            }
            (None, None) => unreachable!("a scheduler has fixed steps or a policy"),
        }
    }

    /// Fills `batch` with `(id, steps_r)` of every running request (the `i`-th in admission order
    /// runs `verify.steps_for(i, steps)`, capped near its end) and returns the KV pages that needs
    /// and the KV positions the plan will cover.
    fn decode_batch(&self, steps: u32, verify: &VerifyShape, batch: &mut Vec<(u64, u32)>) -> (u64, u64) {
        let ctx = u64::from(self.config.context_length);
        batch.clear();
        let (mut need, mut n_kv) = (0u64, 0u64);
        for id in &self.admitted {
            let r = &self.requests[id];
            if r.state != RequestState::Running {
                continue;
            }
            let steps_r = u64::from(verify.steps_for(batch.len(), steps)).min(r.remaining(ctx) - 1);
            need += self
                .pool
                .pages_needed(*id, steps_r + 1)
                .expect("running request has a page table");
            n_kv += r.kv_len + steps_r + 1;
            batch.push((*id, steps_r as u32));
        }
        (need, n_kv)
    }

    fn schedule_prefill(&mut self) -> Option<Plan> {
        if self.partial.is_none() && self.waiting.is_empty() {
            return None;
        }
        let ctx = u64::from(self.config.context_length);
        let page_size = u64::from(self.config.page_size);
        let smax = self.max_steps();
        // Free pages and the cache-only ones eviction can free.
        let mut free = self.available_pages();
        // Pages one decode iteration of every running request may need at the largest steps.
        let mut reserve = 0u64;
        for id in &self.admitted {
            let r = &self.requests[id];
            if r.state == RequestState::Running {
                let tokens = u64::from(smax).min(r.remaining(ctx).saturating_sub(1)) + 1;
                reserve += self
                    .pool
                    .pages_needed(*id, tokens)
                    .expect("admitted request has a page table");
            }
        }
        // Scratch slots of a tree iteration for them and each request whose prefill ends now.
        let mut decoders = self.num_running as u64;
        reserve += self.scratch_pages(decoders);
        let mut budget = u64::from(self.config.max_prefill_tokens);
        // SGLang's chunked_prefill_size: one request's chunk, whatever room the budget has
        let chunk_cap = self.config.chunked_prefill_size.map_or(u64::MAX, u64::from);
        // (id, start, end, prefill done, samples its first token, admitted now)
        let mut chunks: Vec<(u64, u64, u64, bool, bool, bool)> = Vec::new();

        if let Some(id) = self.partial {
            let r = &self.requests[&id];
            let (start, target) = (r.kv_len, r.prefill_target());
            let chunk = (target - start).min(budget).min(chunk_cap);
            let done = start + chunk == target;
            let extra = if done {
                r.decode_tokens_after_prefill(smax, ctx)
            } else {
                0
            };
            let scratch = if done { self.scratch_pages(decoders + 1) - self.scratch_pages(decoders) } else { 0 };
            let need_total = self
                .pool
                .pages_needed(id, chunk + extra)
                .expect("partial request has a page table");
            if need_total + scratch + reserve > free {
                return None;
            }
            let need_now = self
                .pool
                .pages_needed(id, chunk)
                .expect("partial request has a page table");
            free -= need_now;
            reserve += need_total - need_now + scratch;
            decoders += u64::from(done);
            budget -= chunk;
            chunks.push((id, start, start + chunk, done, done && r.output_len() == 0, false));
            if done {
                self.partial = None;
            }
        }
        if self.partial.is_none() {
            self.order_by_cached_prefix();
            while budget > 0 && self.admitted.len() < self.config.max_running_requests as usize {
                let Some(&id) = self.waiting.front() else {
                    break;
                };
                // The cached prefix it would take: pages no longer evictable once taken.
                let nodes = self.lookup(id);
                let pages = self.cache.pages(&nodes);
                let cached = nodes.len() as u64 * page_size;
                let taken = pages.iter().filter(|&&p| self.pool.holders(p) == Some(1)).count() as u64;
                let r = &self.requests[&id];
                let target = r.prefill_target();
                let chunk = (target - cached).min(budget).min(chunk_cap);
                let done = cached + chunk == target;
                let extra = if done {
                    r.decode_tokens_after_prefill(smax, ctx)
                } else {
                    0
                };
                let need_total = (cached + chunk + extra).div_ceil(page_size) - nodes.len() as u64;
                let need_now = (cached + chunk).div_ceil(page_size) - nodes.len() as u64;
                let scratch = if done { self.scratch_pages(decoders + 1) - self.scratch_pages(decoders) } else { 0 };
                if need_total + scratch + reserve + taken > free
                    || self.overlaps_plan(&r.tokens[..target as usize], cached, &chunks)
                {
                    break;
                }
                free -= need_now + taken;
                reserve += need_total - need_now + scratch;
                decoders += u64::from(done);
                budget -= chunk;
                self.waiting.pop_front();
                let r = self
                    .requests
                    .get_mut(&id)
                    .expect("waiting request is known");
                if r.admitted_before {
                    self.waiting_preempted -= 1;
                } else {
                    self.counters.prompt_tokens += r.prompt_len;
                    self.counters.cached_tokens += cached.min(r.prompt_len);
                }
                r.cached = cached;
                r.kv_len = cached;
                r.cache_pages = nodes.len();
                r.cache_node = nodes.last().copied().unwrap_or(ROOT);
                r.cache_drafter_pages = self.cache.drafter_pages(&nodes);
                r.cache_stopped = false;
                r.admitted_before = true;
                r.state = RequestState::Prefilling;
                r.row = Some(
                    self.free_rows
                        .pop()
                        .expect("admitted < max_running_requests leaves a free row"),
                );
                self.pool
                    .add_request_with_prefix(id, &pages)
                    .expect("waiting request has no page table; its prefix pages are cached");
                self.admitted.push(id);
                let sample = done && r.output_len() == 0;
                chunks.push((id, cached, cached + chunk, done, sample, true));
                if !done {
                    // one partial request at a time (its next chunk comes first next time)
                    self.partial = Some(id);
                    break;
                }
            }
        }
        if chunks.is_empty() {
            return None;
        }

        let b = chunks.len();
        let draft_prefill = !(self.config.skip_zero_step_draft_extend && self.last_decode_steps == Some(0));
        let n_tokens: u64 = chunks.iter().map(|c| c.2 - c.1).sum();
        let n_kv: u64 = chunks.iter().map(|c| c.2).sum();
        let n_kv = self.plan_kv_layout.then_some(n_kv as usize);
        let mut a = Arrays::with_capacity(b, n_tokens as usize, n_tokens as usize, n_kv);
        let (mut done_v, mut sample_v) = (Vec::with_capacity(b), Vec::with_capacity(b));
        let mut logits_indices = Vec::new();
        let mut ids = Vec::with_capacity(b);
        let need: u64 = chunks
            .iter()
            .map(|c| self.pool.pages_needed(c.0, c.2 - c.1).expect("admitted"))
            .sum();
        self.make_free(need);
        for &(id, start, end, done, sample, admitted) in &chunks {
            let r = self.requests.get_mut(&id).expect("chunk request is known");
            self.pool
                .reserve_into(id, end - start, &mut a.out_loc)
                .expect("pages were counted");
            r.kv_len = end;
            if admitted {
                // a (re)start: the drafter's rows start afresh too, with the cached pages that
                // carry the drafter's KV filled in; the drafter runs over the rest of the hit
                let drafted = r.cache_drafter_pages as u64 * page_size;
                r.draft_lag = start - drafted;
                a.cached_lens.push(start as i64);
                a.cached_draft_lens.push(drafted as i64);
                self.pool
                    .kv_indices_into(id, 0, start, &mut a.cached_kv_indices)
                    .expect("the cached prefix is in its page table");
                a.cached_ids.extend_from_slice(&r.tokens[..start as usize]);
            } else {
                a.cached_lens.push(0);
                a.cached_draft_lens.push(0);
            }
            if draft_prefill {
                r.draft_lag = 0; // the worker's drafter prefill catches the whole row up
            } else {
                r.draft_lag += end - start;
            }
            a.request_ids.push(id as i64);
            a.rows
                .push(i64::from(r.row.expect("an admitted request holds a row")));
            a.input_ids
                .extend_from_slice(&r.tokens[start as usize..end as usize]);
            a.positions.extend(start as i64..end as i64);
            a.qo_lens.push((end - start) as i64);
            a.kv_lens.push(end as i64);
            if self.plan_kv_layout {
                push_context(
                    &mut a,
                    self.pool.pages(id).expect("registered"),
                    page_size,
                    end,
                );
            }
            done_v.push(i64::from(done));
            sample_v.push(i64::from(sample));
            if sample {
                logits_indices.push(a.input_ids.len() as i64 - 1);
            }
            ids.push(id);
        }
        self.decode_turn = self.partial.is_some();
        self.counters.prefill_iterations += 1;
        self.counters.prefill_tokens += n_tokens;
        self.in_flight = Some(InFlight {
            kind: PlanKind::Prefill,
            ids,
            steps: 0,
            from_policy: false,
            context: 0,
            predicted: None,
            steps_r: Vec::new(),
            done: done_v.iter().map(|&d| d == 1).collect(),
            sample: sample_v.iter().map(|&s| s == 1).collect(),
            catch_up: 0,
            tree: None,
            skip: Vec::new(),
            min_survival: 0.0,
        });
        Some(Plan {
            kind: PlanKind::Prefill,
            request_ids: a.request_ids,
            rows: a.rows,
            input_ids: a.input_ids,
            positions: a.positions,
            out_loc: a.out_loc,
            qo_lens: a.qo_lens,
            kv_lens: a.kv_lens,
            kv_indices: a.kv_indices,
            page_table: a.page_table,
            page_table_offsets: a.page_table_offsets,
            steps: 0,
            graph_bs: None,
            steps_per_request: Vec::new(),
            prefill_done: done_v,
            sample_first: sample_v,
            logits_indices,
            preempted: std::mem::take(&mut self.pending_preempted),
            draft_prefill,
            skip_extend: Vec::new(),
            min_survival: 0.0,
            cached_lens: a.cached_lens,
            cached_draft_lens: a.cached_draft_lens,
            cached_kv_indices: a.cached_kv_indices,
            cached_ids: a.cached_ids,
            tree_topk: 1,
            num_draft_tokens: 0,
            scratch_loc: Vec::new(),
        })
    }

    fn schedule_decode(&mut self) -> Option<Plan> {
        let page_size = u64::from(self.config.page_size);
        // (id, steps_r) of the running requests in admission order, for the chosen steps.
        let mut batch: Vec<(u64, u32)> = Vec::with_capacity(self.num_running);
        // Capacity first: the decided steps, else fewer (the slot's lower candidates), else
        // preempt the most recently admitted request and decide again for the smaller batch.
        let (steps, graph_bs, n_kv, context, need, tree, min_survival) = 'fit: loop {
            if self.num_running == 0 {
                return None;
            }
            let (context, lag) = self
                .admitted
                .iter()
                .map(|id| &self.requests[id])
                .filter(|r| r.state == RequestState::Running)
                .fold((0u64, 0u64), |(c, l), r| (c + r.kv_len, l + r.draft_lag));
            let (decided, verify, graph_bs, lower, tree, min_survival) = self.decide(self.num_running, context, lag);
            let trees = std::iter::once(tree).chain(std::iter::repeat(None));
            for (steps, tree) in std::iter::once(decided).chain(lower).zip(trees) {
                let (need, n_kv) = self.decode_batch(steps, &verify, &mut batch);
                let need = need + self.scratch_pages_for(tree, batch.len());
                if need <= self.available_pages() {
                    break 'fit (steps, graph_bs, n_kv, context, need, tree, min_survival);
                }
            }
            self.preempt_last();
        };

        let b = batch.len();
        let n_tokens: usize = batch.iter().map(|&(_, s)| s as usize + 1).sum();
        let n_kv = self.plan_kv_layout.then_some(n_kv as usize);
        let mut a = Arrays::with_capacity(b, n_tokens, b, n_kv);
        let mut steps_per_request = Vec::with_capacity(b);
        // A request at verify budget 0 runs no draft forward; with the zero-step extend skipped
        // it skips its draft extend too (its drafter lags by what it emits, caught up before it
        // next drafts), so catch-up runs this iteration only for the requests that draft, or
        // extend, now.
        let skip_rule = self.config.skip_zero_step_draft_extend;
        let mut skip_extend = Vec::with_capacity(b);
        let mut catch_up = 0u64;
        self.make_free(need);
        for &(id, steps_r) in &batch {
            let r = self
                .requests
                .get_mut(&id)
                .expect("running request is known");
            let len = r.kv_len;
            let n = u64::from(steps_r) + 1;
            self.pool
                .reserve_into(id, n, &mut a.out_loc)
                .expect("pages were counted");
            r.kv_len = len + n;
            a.request_ids.push(id as i64);
            a.rows
                .push(i64::from(r.row.expect("a running request holds a row")));
            a.input_ids
                .push(*r.tokens.last().expect("a running request has tokens"));
            a.positions.push(len as i64);
            a.qo_lens.push(n as i64);
            a.kv_lens.push((len + n) as i64);
            if self.plan_kv_layout {
                push_context(
                    &mut a,
                    self.pool.pages(id).expect("registered"),
                    page_size,
                    len + n,
                );
            }
            steps_per_request.push(i64::from(steps_r));
            let skip = skip_rule && steps_r == 0;
            skip_extend.push(i64::from(skip));
            if steps > 0 && !skip {
                catch_up += r.draft_lag;
            }
        }
        let mut scratch_loc = Vec::new();
        self.reserve_scratch(tree, b, &mut scratch_loc);
        self.in_flight = Some(InFlight {
            kind: PlanKind::Decode,
            ids: batch.iter().map(|&(id, _)| id).collect(),
            steps,
            from_policy: self.fixed_steps.is_none(),
            context,
            predicted: self.policy.as_ref().and_then(|p| p.goodput()).and_then(|g| {
                g.last_decision().and_then(|d| d.candidates.iter().find(|c| c.0 == steps).map(|c| c.1))
            }),
            steps_r: batch.iter().map(|&(_, s)| s).collect(),
            done: Vec::new(),
            sample: Vec::new(),
            catch_up,
            tree,
            skip: skip_extend.iter().map(|&s| s == 1).collect(),
            min_survival: if steps > 0 { min_survival } else { 0.0 },
        });
        Some(Plan {
            kind: PlanKind::Decode,
            request_ids: a.request_ids,
            rows: a.rows,
            input_ids: a.input_ids,
            positions: a.positions,
            out_loc: a.out_loc,
            qo_lens: a.qo_lens,
            kv_lens: a.kv_lens,
            kv_indices: a.kv_indices,
            page_table: a.page_table,
            page_table_offsets: a.page_table_offsets,
            steps,
            graph_bs,
            steps_per_request,
            prefill_done: Vec::new(),
            sample_first: Vec::new(),
            logits_indices: Vec::new(),
            preempted: std::mem::take(&mut self.pending_preempted),
            draft_prefill: true,
            skip_extend,
            min_survival: if steps > 0 { min_survival } else { 0.0 },
            cached_lens: Vec::new(),
            cached_draft_lens: Vec::new(),
            cached_kv_indices: Vec::new(),
            cached_ids: Vec::new(),
            tree_topk: tree.map_or(1, |t| t.topk),
            num_draft_tokens: tree.map_or(steps, |t| t.num_draft_tokens),
            scratch_loc,
        })
    }

    /// Preempts the most recently admitted request: frees its pages and puts it at the front of
    /// the waiting queue, tokens kept.
    fn preempt_last(&mut self) {
        let id = self
            .admitted
            .pop()
            .expect("preemption needs an admitted request");
        let r = self
            .requests
            .get_mut(&id)
            .expect("admitted request is known");
        self.pool
            .free_request(id)
            .expect("admitted request has a page table");
        if r.state == RequestState::Running {
            self.num_running -= 1;
        }
        if self.partial == Some(id) {
            self.partial = None;
        }
        r.state = RequestState::Waiting;
        r.kv_len = 0;
        self.free_rows
            .push(r.row.take().expect("an admitted request holds a row"));
        r.num_preemptions += 1;
        self.waiting.push_front(id);
        self.waiting_preempted += 1;
        self.counters.preemptions += 1;
        self.pending_preempted.push(id as i64);
    }
}

/// Appends a request's page table and the KV indices of its positions `0 .. len` (`kv_indices`).
fn push_context(a: &mut Arrays, pages: &[u32], page_size: u64, len: u64) {
    a.page_table.extend(pages.iter().map(|&p| i64::from(p)));
    a.page_table_offsets.push(a.page_table.len() as i64);
    let ps = page_size as i64;
    let full = (len / page_size) as usize;
    // Whole pages: an iota per page (vectorizes), then the partial last page.
    for &p in &pages[..full] {
        let base = i64::from(p) * ps;
        a.kv_indices.extend((0..ps).map(|k| base + k));
    }
    let rest = (len % page_size) as i64;
    if rest > 0 {
        let base = i64::from(pages[full]) * ps;
        a.kv_indices.extend((0..rest).map(|k| base + k));
    }
}
