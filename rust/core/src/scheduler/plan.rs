//! What one iteration runs ([`Plan`]) and what its report changed ([`ReportOutcome`]).

use super::request::Finished;
use super::stats::SchedulerStats;

/// Prefill (prompt chunks) or decode (draft + verify over every running request).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanKind {
    Prefill,
    Decode,
}

impl PlanKind {
    /// `"prefill"` or `"decode"`.
    pub fn as_str(self) -> &'static str {
        match self {
            PlanKind::Prefill => "prefill",
            PlanKind::Decode => "decode",
        }
    }
}

/// One iteration's work. `B` = `request_ids.len()`. All index arrays are `i64` so they go
/// straight into torch index tensors; every per-request array is in `request_ids` order, and
/// every concatenated array is request after request.
///
/// **Prefill**: request `b` computes KV positions `kv_lens[b] - qo_lens[b] .. kv_lens[b]` (a chunk
/// of its prefill range). `input_ids`, `positions`, `out_loc` have `N = sum(qo_lens)` entries:
/// the tokens, their positions and the KV slots to write. A request whose prefill range ends in
/// this chunk has `prefill_done[b] == 1`; if it has no output yet (`sample_first[b] == 1`) the
/// caller samples its first token from the logits at `input_ids[logits_indices[i]]` and reports
/// it; a request resuming after preemption (`prefill_done == 1`, `sample_first == 0`) samples
/// nothing (its last token is the input of its next decode).
///
/// **Decode**: request `b` with `L = positions[b]` KV positions feeds its last emitted token
/// `input_ids[b]` at position `L`; its `steps_per_request[b]` drafts go to positions
/// `L + 1 ..= L + steps_per_request[b]`. `out_loc` holds the KV indices of positions
/// `L ..= L + steps_per_request[b]` (`qo_lens[b] = steps_per_request[b] + 1` each), already
/// reserved. `input_ids` and `positions` have `B` entries.
///
/// Both: `rows[b]` = the worker row request `b` holds (assigned at admission, unique among
/// admitted requests; a prefill chunk starting at position 0 starts its row afresh);
/// `kv_lens[b]` = KV positions after this iteration's writes. Only when the scheduler's
/// `plan_kv_layout` is on (empty otherwise): `kv_indices` = the KV indices of positions
/// `0 .. kv_lens[b]` of every request, concatenated (the torch backend's `plan(qo_lens, kv_lens,
/// kv_indices)`); `page_table` = every request's page ids in token order, concatenated, request
/// `b` at `page_table_offsets[b] .. page_table_offsets[b + 1]` (flashinfer's `paged_kv_indices`
/// / `paged_kv_indptr`).
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub kind: PlanKind,
    /// `[B]` request ids.
    pub request_ids: Vec<i64>,
    /// `[B]` worker rows (`0 .. max_running_requests`), unique.
    pub rows: Vec<i64>,
    /// Prefill `[N]` chunk tokens; decode `[B]` last emitted token per request.
    pub input_ids: Vec<i64>,
    /// Prefill `[N]` position of each token; decode `[B]` position `L` of each input token.
    pub positions: Vec<i64>,
    /// `[sum(qo_lens)]` KV slots written this iteration.
    pub out_loc: Vec<i64>,
    /// `[B]` query tokens per request.
    pub qo_lens: Vec<i64>,
    /// `[B]` KV positions per request after this iteration's writes.
    pub kv_lens: Vec<i64>,
    /// `[sum(kv_lens)]` KV indices of positions `0 .. kv_lens[b]`, request after request (empty
    /// unless `plan_kv_layout`).
    pub kv_indices: Vec<i64>,
    /// `[sum(pages)]` page ids, request after request (empty unless `plan_kv_layout`).
    pub page_table: Vec<i64>,
    /// `[B + 1]` offsets into `page_table` (empty unless `plan_kv_layout`).
    pub page_table_offsets: Vec<i64>,
    /// Decode: the steps chosen for the batch (0 = plain decoding). Prefill: 0.
    pub steps: u32,
    /// Decode: the padded CUDA-graph batch size (`None`: eager). Prefill: `None`.
    pub graph_bs: Option<u32>,
    /// Decode `[B]`: `min(steps, r - 1)` where `r` = output tokens the request may still produce.
    /// Prefill: empty.
    pub steps_per_request: Vec<i64>,
    /// Prefill `[B]`: 1 where this chunk ends the request's prefill range. Decode: empty.
    pub prefill_done: Vec<i64>,
    /// Prefill `[B]`: 1 where the request samples its first token from this chunk. Decode: empty.
    pub sample_first: Vec<i64>,
    /// Prefill `[sum(sample_first)]`: indices into `input_ids` whose logits are sampled, in
    /// request order. Decode: empty.
    pub logits_indices: Vec<i64>,
    /// Requests preempted while building this plan: the caller drops their state (KV is already
    /// freed); they come back in a later prefill plan from position 0. In preemption order.
    pub preempted: Vec<i64>,
    /// Prefill: whether the drafter runs over these chunks now (false: the worker leaves them to
    /// the catch-up of the next drafting iteration, because decoding runs steps 0 with the
    /// zero-step extend skipped; see `SchedulerConfig::skip_zero_step_draft_extend`). Decode:
    /// true.
    pub draft_prefill: bool,
    /// Decode `[B]` (issue 28): 1 where the request skips the draft extend after this verify
    /// (its verify budget is 0 and `skip_zero_step_draft_extend` is on: it drafts nothing now,
    /// and the drafter catches it up before it next drafts, as after a steps-0 iteration),
    /// else 0. The worker also leaves a request at budget 0 out of the catch-up before
    /// drafting. Prefill: empty.
    pub skip_extend: Vec<i64>,
    /// Decode (issue 28, [`crate::decision::ConfidenceStop`]): the worker stops each request's
    /// verify at the first draft position whose cumulative draft probability is below this;
    /// `0.0` = no rule (always at steps 0 and for prefill). Request `b` then verifies
    /// `v_b = min(steps_per_request[b], leading positions with cumulative probability >=
    /// min_survival)` drafts; its KV slots beyond `v_b + accepted` are freed at the report like
    /// rejected ones.
    pub min_survival: f32,
    /// Prefill `[B]`: KV positions request `b` takes from the prefix cache at its admission in
    /// this plan (its chunk then starts there: `kv_lens[b] - qo_lens[b] == cached_lens[b]`,
    /// whole pages), 0 for a chunk continuing an earlier admission. A chunk with
    /// `kv_lens[b] - qo_lens[b] == cached_lens[b]` is an admission: the worker (re)starts the
    /// row, fills positions `0 .. cached_lens[b]` from `cached_kv_indices` / `cached_ids`, and
    /// counts the first `cached_draft_lens[b]` of them as drafter-covered. Decode: empty.
    pub cached_lens: Vec<i64>,
    /// Prefill `[B]`: of request `b`'s `cached_lens[b]` positions, the leading ones whose pages
    /// carry the drafter's KV (whole pages; the EAGLE features are there for every cached
    /// position, the target wrote them). The drafter runs over the rest like over a deferred
    /// prefill: with this plan's drafter prefill, or at the next drafting iteration's catch-up.
    /// Decode: empty.
    pub cached_draft_lens: Vec<i64>,
    /// Prefill `[sum(cached_lens)]`: KV indices of the cached positions, request after request.
    pub cached_kv_indices: Vec<i64>,
    /// Prefill `[sum(cached_lens)]`: token ids of the cached positions, request after request.
    pub cached_ids: Vec<i64>,
    /// Decode: children per frontier node of the draft tree (`speculative_eagle_topk`), 1 for a
    /// chain. Prefill: 1.
    pub tree_topk: u32,
    /// Decode: draft tokens per request, the root excluded: the tree's nodes `N` (SGLang's
    /// `speculative_num_draft_tokens - 1`), `steps` for a chain. Prefill: 0.
    pub num_draft_tokens: u32,
    /// Decode tree `[B * N]`: KV slots for the tree nodes, request `b` at `b * N .. (b + 1) * N`,
    /// reserved besides `out_loc` (which a tree iteration lays out as a chain of
    /// `steps_per_request[b]` steps, its acceptance cap) and freed by the core when this plan's
    /// report comes in (`scheduler/tree.rs`). Chain and prefill: empty.
    pub scratch_loc: Vec<i64>,
}

/// Which captured CUDA graph a decode iteration replays: `Chain(steps, padded batch size)`, or
/// `Tree(depth, topk, N, padded batch size)` for a draft tree (`N` = `Plan::num_draft_tokens`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GraphKey {
    Chain(u32, u32),
    Tree(u32, u32, u32, u32),
}

impl Plan {
    pub fn batch_size(&self) -> usize {
        self.request_ids.len()
    }

    /// The graph key: `(steps, padded batch size)` for a chain, `(depth, topk, N, padded batch
    /// size)` for a tree; the padded size is the batch size when no graph fits.
    pub fn graph_key(&self) -> GraphKey {
        let bs = self.graph_bs.unwrap_or(self.request_ids.len() as u32);
        if self.tree_topk > 1 {
            GraphKey::Tree(self.steps, self.tree_topk, self.num_draft_tokens, bs)
        } else {
            GraphKey::Chain(self.steps, bs)
        }
    }

    /// Decode: `out_loc` laid out as `[B, steps + 1]`, the slots beyond a request's
    /// `steps_per_request` filled with `pad_slot` (for a fixed-shape graph). Prefill: `out_loc`.
    pub fn out_loc_padded(&self, pad_slot: i64) -> Vec<i64> {
        if self.kind == PlanKind::Prefill {
            return self.out_loc.clone();
        }
        let n = self.steps as usize + 1;
        let mut out = Vec::with_capacity(self.batch_size() * n);
        let mut start = 0;
        for &q in &self.qo_lens {
            let q = q as usize;
            out.extend_from_slice(&self.out_loc[start..start + q]);
            out.extend(std::iter::repeat(pad_slot).take(n - q));
            start += q;
        }
        out
    }
}

/// What one `report` changed, in the plan's request order, and the state after it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ReportOutcome {
    /// `[B]` the plan's request ids.
    pub request_ids: Vec<i64>,
    /// Tokens appended to each request's output (after stop truncation), request after request.
    pub new_tokens: Vec<i64>,
    /// `[B + 1]` offsets into `new_tokens`. A request aborted or finished while the plan was in
    /// flight gets none.
    pub new_offsets: Vec<i64>,
    /// Requests that finished in this report (their pages are free), in request order.
    pub finished: Vec<Finished>,
    /// [`super::Scheduler::stats`] after the report.
    pub stats: SchedulerStats,
    /// [`super::Scheduler::slot_states`] after the report.
    pub slot_states: Vec<(u32, u32, f64, u64)>,
}

/// One verify, as `specdial policy replay` reads it (`{"batch_size", "accepted", "steps"}`).
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRecord {
    pub batch_size: u32,
    pub steps: u32,
    /// Accepted drafts per request, bonus excluded, in plan order (`batch_size` entries).
    pub accepted: Vec<i64>,
    /// Present only when some request's steps were capped below `steps` (near its
    /// `max_new_tokens` or the context end) or the decision gave per-request lengths: every
    /// request's `steps_per_request`. The live policy was fed only the requests with
    /// `steps_per_request == steps` (with a confidence stop: `verified == steps`).
    pub steps_per_request: Option<Vec<i64>>,
    /// The plan's confidence stop threshold, present only when it had one (issue 28).
    pub min_survival: Option<f32>,
    /// Present with `min_survival`: the draft tokens each request verified after the cut
    /// (`0 ..= steps_per_request[b]`).
    pub verified: Option<Vec<i64>>,
    /// The batch's KV tokens before the iteration.
    pub context_tokens: u64,
    /// The iteration's measured seconds, when reported.
    pub seconds: Option<f64>,
    /// The `goodput` cost model's prediction of those seconds when it decided.
    pub predicted_seconds: Option<f64>,
    /// Present only for a draft-tree iteration (issue 29): its `(topk, N)`, `N` the tree
    /// nodes per request with the root excluded (`Plan::num_draft_tokens`, SGLang's
    /// `speculative_num_draft_tokens - 1`); the depth is `steps`. Absent: a chain.
    pub tree: Option<(u32, u32)>,
}

impl TraceRecord {
    /// One JSON line (no newline): `{"batch_size": B, "accepted": [...], "steps": k,
    /// "context_tokens": C}` plus `"seconds"`, `"predicted_seconds"`, `"steps_per_request"`,
    /// `"min_survival"` and `"verified"` when present, and `"tree_topk"`, `"tree_nodes"` for a
    /// draft-tree iteration.
    pub fn to_json(&self) -> String {
        let mut v = serde_json::json!({
            "batch_size": self.batch_size,
            "accepted": self.accepted,
            "steps": self.steps,
            "context_tokens": self.context_tokens,
        });
        if let Some(t) = self.seconds {
            v["seconds"] = serde_json::json!(t);
        }
        if let Some(t) = self.predicted_seconds {
            v["predicted_seconds"] = serde_json::json!(t);
        }
        if let Some(s) = &self.steps_per_request {
            v["steps_per_request"] = serde_json::json!(s);
        }
        if let Some(m) = self.min_survival {
            v["min_survival"] = serde_json::json!(m);
        }
        if let Some(s) = &self.verified {
            v["verified"] = serde_json::json!(s);
        }
        if let Some((topk, nodes)) = self.tree {
            v["tree_topk"] = serde_json::json!(topk);
            v["tree_nodes"] = serde_json::json!(nodes);
        }
        v.to_string()
    }
}
