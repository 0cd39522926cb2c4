//! One request's tokens, limits and state, and the stop rules applied to each emitted token.

use std::fmt;

/// Where a live request is. Finished requests leave the scheduler (see [`FinishReason`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestState {
    /// In the waiting queue, holding no KV pages (new, or preempted and waiting to resume).
    Waiting,
    /// Admitted and holding pages; its prefill (or re-prefill after preemption) is in progress,
    /// or its last chunk is in the plan in flight.
    Prefilling,
    /// Prefilled; takes part in decode iterations.
    Running,
}

impl RequestState {
    /// `"waiting"`, `"prefilling"` or `"running"`.
    pub fn as_str(self) -> &'static str {
        match self {
            RequestState::Waiting => "waiting",
            RequestState::Prefilling => "prefilling",
            RequestState::Running => "running",
        }
    }
}

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_new_tokens` output tokens, or `context_length` tokens in all.
    Length,
    /// An EOS token (unless `ignore_eos`) or one of the request's `stop_token_ids` (the token,
    /// which is the last output token), or a stop string matched by the caller (`None`).
    Stop(Option<i64>),
    /// Aborted by the caller.
    Abort,
}

impl FinishReason {
    /// `"length"`, `"stop"` or `"abort"` (OpenAI's `finish_reason` names, plus abort).
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop(_) => "stop",
            FinishReason::Abort => "abort",
        }
    }

    /// The stop token that finished the request, if any.
    pub fn stop_token_id(self) -> Option<i64> {
        match self {
            FinishReason::Stop(t) => t,
            _ => None,
        }
    }
}

impl fmt::Display for FinishReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FinishReason::Stop(Some(t)) => write!(f, "stop (token {t})"),
            other => f.write_str(other.as_str()),
        }
    }
}

/// A request that left the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    pub request_id: u64,
    pub reason: FinishReason,
    /// Output tokens it produced in all (the finishing token included).
    pub output_len: u64,
    /// Prompt tokens served from the prefix cache at its latest admission (0 when it was never
    /// admitted, or the cache is off): OpenAI's `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
}

#[derive(Debug, Clone)]
pub(crate) struct Request {
    /// Prompt then output tokens.
    pub tokens: Vec<i64>,
    pub prompt_len: u64,
    pub max_new_tokens: u64,
    pub stop_token_ids: Vec<i64>,
    pub ignore_eos: bool,
    pub state: RequestState,
    /// KV positions held in the pool (== the pool's length of this request while registered).
    pub kv_len: u64,
    /// Admitted at least once: a waiting request with this set was preempted.
    pub admitted_before: bool,
    pub num_preemptions: u32,
    /// The worker row it holds while admitted (prefilling or running), `None` while waiting.
    pub row: Option<u32>,
    /// KV positions the drafter has not run over yet (a deferred drafter prefill, tokens of
    /// steps-0 iterations whose extend was skipped, cached pages taken without the drafter's
    /// KV): the catch-up its next drafting iteration runs. At an admission, the positions of
    /// its cached prefix past the pages that carry the drafter's KV.
    pub draft_lag: u64,
    /// KV positions served from the prefix cache at its latest admission (0: none).
    pub cached: u64,
    /// Most KV positions an admission may take from the prefix cache (`u64::MAX`: no limit).
    pub max_cached: u64,
    /// Its leading pages that are prefix-cache pages (taken at admission or cached since).
    pub cache_pages: usize,
    /// The tree node of its last cached page (`prefix_cache::ROOT` when none).
    pub cache_node: usize,
    /// Its leading cached pages marked as carrying the drafter's KV (<= `cache_pages`).
    pub cache_drafter_pages: usize,
    /// Another page with the same tokens was cached first: it caches no more pages.
    pub cache_stopped: bool,
}

impl Request {
    pub fn output_len(&self) -> u64 {
        self.tokens.len() as u64 - self.prompt_len
    }

    /// Its finish record: `output_len` tokens produced, `cached_tokens` the prompt tokens of
    /// its latest admission's cached prefix.
    pub fn finished(&self, request_id: u64, reason: FinishReason) -> Finished {
        Finished {
            request_id,
            reason,
            output_len: self.output_len(),
            cached_tokens: self.cached.min(self.prompt_len),
        }
    }

    /// Output tokens it may still produce: bounded by `max_new_tokens` and the context end.
    pub fn remaining(&self, context_length: u64) -> u64 {
        let by_new = self.max_new_tokens.saturating_sub(self.output_len());
        let by_ctx = context_length.saturating_sub(self.tokens.len() as u64);
        by_new.min(by_ctx)
    }

    /// KV positions its prefill covers: the prompt when it has no output yet (the first token
    /// is then sampled), else every token but the last (which the next decode feeds).
    pub fn prefill_target(&self) -> u64 {
        if self.output_len() == 0 {
            self.prompt_len
        } else {
            self.tokens.len() as u64 - 1
        }
    }

    /// KV positions its next decode iteration writes, at most, once prefilled: `min(steps,
    /// r - 1) + 1` where `r` is what it may produce after the prefill.
    pub fn decode_tokens_after_prefill(&self, steps: u32, context_length: u64) -> u64 {
        let r = if self.output_len() == 0 {
            // After its first token.
            self.max_new_tokens
                .saturating_sub(1)
                .min(context_length.saturating_sub(self.prompt_len + 1))
        } else {
            self.remaining(context_length)
        };
        u64::from(steps).min(r.saturating_sub(1)) + 1
    }

    /// Appends emitted tokens in order until one finishes the request; tokens after the finishing
    /// one are dropped. Returns how many were appended and the finish reason, if any.
    pub fn append(
        &mut self,
        emitted: &[i64],
        eos: &[i64],
        context_length: u64,
    ) -> (usize, Option<FinishReason>) {
        for (i, &t) in emitted.iter().enumerate() {
            self.tokens.push(t);
            let reason =
                if (!self.ignore_eos && eos.contains(&t)) || self.stop_token_ids.contains(&t) {
                    Some(FinishReason::Stop(Some(t)))
                } else if self.output_len() >= self.max_new_tokens
                    || self.tokens.len() as u64 >= context_length
                {
                    Some(FinishReason::Length)
                } else {
                    None
                };
            if reason.is_some() {
                return (i + 1, reason);
            }
        }
        (emitted.len(), None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(prompt: usize, max_new: u64, stop: &[i64], ignore_eos: bool) -> Request {
        Request {
            tokens: vec![1; prompt],
            prompt_len: prompt as u64,
            max_new_tokens: max_new,
            stop_token_ids: stop.to_vec(),
            ignore_eos,
            state: RequestState::Waiting,
            kv_len: 0,
            admitted_before: false,
            num_preemptions: 0,
            row: None,
            draft_lag: 0,
            cached: 0,
            max_cached: u64::MAX,
            cache_pages: 0,
            cache_node: 0,
            cache_drafter_pages: 0,
            cache_stopped: false,
        }
    }

    #[test]
    fn eos_stops_and_drops_the_rest() {
        let mut r = req(3, 10, &[], false);
        assert_eq!(
            r.append(&[5, 2, 7], &[2], 100),
            (2, Some(FinishReason::Stop(Some(2))))
        );
        assert_eq!(r.tokens, vec![1, 1, 1, 5, 2]);
    }

    #[test]
    fn ignore_eos_keeps_going_but_stop_tokens_still_stop() {
        let mut r = req(3, 10, &[9], true);
        assert_eq!(r.append(&[2, 2], &[2], 100), (2, None));
        assert_eq!(
            r.append(&[9, 4], &[2], 100),
            (1, Some(FinishReason::Stop(Some(9))))
        );
        assert_eq!(r.output_len(), 3);
    }

    #[test]
    fn max_new_tokens_and_context_end_are_length() {
        let mut r = req(3, 2, &[], false);
        assert_eq!(r.remaining(100), 2);
        assert_eq!(
            r.append(&[4, 5, 6], &[], 100),
            (2, Some(FinishReason::Length))
        );
        let mut r = req(3, 10, &[], false);
        assert_eq!(r.remaining(5), 2);
        assert_eq!(
            r.append(&[4, 5, 6], &[], 5),
            (2, Some(FinishReason::Length))
        );
        assert_eq!(r.tokens.len(), 5);
    }

    #[test]
    fn stop_beats_length_on_the_same_token() {
        let mut r = req(3, 1, &[4], false);
        assert_eq!(
            r.append(&[4], &[], 100),
            (1, Some(FinishReason::Stop(Some(4))))
        );
    }

    #[test]
    fn prefill_target_and_decode_reserve() {
        let mut r = req(5, 4, &[], false);
        assert_eq!(r.prefill_target(), 5);
        // After the first token 3 more may come: at most 2 drafts + 1.
        assert_eq!(r.decode_tokens_after_prefill(7, 100), 3);
        assert_eq!(r.decode_tokens_after_prefill(1, 100), 2);
        r.tokens.extend([7, 8]);
        assert_eq!(r.prefill_target(), 6);
        assert_eq!(r.decode_tokens_after_prefill(7, 100), 2);
        // Context end: 7 tokens of 8 leaves 1 to produce.
        assert_eq!(r.decode_tokens_after_prefill(7, 8), 1);
    }

    #[test]
    fn reasons_have_openai_names() {
        assert_eq!(FinishReason::Length.as_str(), "length");
        assert_eq!(FinishReason::Stop(None).as_str(), "stop");
        assert_eq!(FinishReason::Abort.as_str(), "abort");
        assert_eq!(FinishReason::Stop(Some(2)).stop_token_id(), Some(2));
        assert_eq!(FinishReason::Stop(Some(2)).to_string(), "stop (token 2)");
    }
}
