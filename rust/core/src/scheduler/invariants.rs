//! The scheduler's internal invariants, checked against the pool (for tests).

use super::{PlanKind, RequestState, Scheduler};

impl Scheduler {
    /// Checks every internal invariant against the pool (for tests; O(requests)).
    pub fn check_invariants(&self) -> Result<(), String> {
        let cfg = &self.config;
        let ctx = u64::from(cfg.context_length);
        let fail = |m: String| Err(m);
        if self.admitted.len() > cfg.max_running_requests as usize {
            return fail(format!(
                "{} admitted > max_running_requests",
                self.admitted.len()
            ));
        }
        let queued = self.queued_beyond_free_rows();
        if queued > cfg.max_queued_requests as usize {
            return fail(format!(
                "{queued} queued beyond the free running slots > max_queued_requests"
            ));
        }
        if self.requests.len() != self.waiting.len() + self.admitted.len() {
            return fail("requests are not exactly the waiting plus the admitted".into());
        }
        let scratch_pages = self.check_scratch()?;
        let scratch_owner = usize::from(scratch_pages > 0);
        if self.pool.num_requests() != self.admitted.len() + scratch_owner {
            return fail(format!(
                "pool has {} requests, {} admitted",
                self.pool.num_requests(),
                self.admitted.len()
            ));
        }
        let mut preempted = 0;
        for id in &self.waiting {
            let r = self
                .requests
                .get(id)
                .ok_or(format!("waiting {id} unknown"))?;
            if r.state != RequestState::Waiting || r.kv_len != 0 || self.pool.has_request(*id) {
                return fail(format!(
                    "waiting {id} is {:?} with kv_len {}",
                    r.state, r.kv_len
                ));
            }
            preempted += usize::from(r.admitted_before);
        }
        if preempted != self.waiting_preempted {
            return fail("waiting_preempted count is off".into());
        }
        let mut running = 0;
        let mut used_pages = scratch_pages;
        for id in &self.admitted {
            let r = self
                .requests
                .get(id)
                .ok_or(format!("admitted {id} unknown"))?;
            let len = self.pool.len(*id).map_err(|e| e.to_string())?;
            if len != r.kv_len {
                return fail(format!(
                    "request {id}: kv_len {} but pool length {len}",
                    r.kv_len
                ));
            }
            used_pages += self.pool.pages(*id).map_err(|e| e.to_string())?.len() as u64;
            if r.output_len() > r.max_new_tokens || r.tokens.len() as u64 > ctx {
                return fail(format!("request {id} is past its limits"));
            }
            match r.state {
                RequestState::Running => {
                    running += 1;
                    // Between iterations the KV covers the tokens but the last; with a decode
                    // plan in flight, also the request's own verify length (issue 28: KV is
                    // reserved per request, never for the batch's depth).
                    let reserved = match &self.in_flight {
                        None => Some(0),
                        Some(fl) if fl.kind == PlanKind::Decode => {
                            fl.ids.iter().position(|x| x == id).map(|i| u64::from(fl.steps_r[i]) + 1)
                        }
                        Some(_) => None,
                    };
                    if reserved.is_some_and(|n| r.kv_len + 1 != r.tokens.len() as u64 + n) {
                        return fail(format!(
                            "running {id}: kv_len {} with {} tokens and {reserved:?} reserved",
                            r.kv_len,
                            r.tokens.len()
                        ));
                    }
                }
                RequestState::Prefilling => {
                    if r.kv_len > r.prefill_target() {
                        return fail(format!("prefilling {id} is past its prefill range"));
                    }
                }
                RequestState::Waiting => return fail(format!("admitted {id} is waiting")),
            }
        }
        // Rows: every admitted request holds one, no waiting one does, no row is held twice,
        // and the free rows are exactly the others.
        let m = cfg.max_running_requests as usize;
        let mut seen = vec![false; m];
        let held = self.admitted.iter().map(|id| (id, self.requests[id].row));
        let free = self.free_rows.iter().map(|&r| (&u64::MAX, Some(r)));
        for (id, row) in held.chain(free) {
            let row = row.ok_or(format!("admitted {id} holds no row"))? as usize;
            if row >= m || std::mem::replace(&mut seen[row], true) {
                return fail(format!("row {row} is out of range or held twice ({id})"));
            }
        }
        if seen.iter().any(|&s| !s) {
            return fail("a row is neither held nor free".into());
        }
        if let Some(id) = self.waiting.iter().find(|id| self.requests[id].row.is_some()) {
            return fail(format!("waiting {id} holds a row"));
        }
        if running != self.num_running {
            return fail("num_running is off".into());
        }
        if self.config.enable_prefix_caching {
            self.check_cache()?;
        } else if used_pages != u64::from(self.pool.num_used_pages()) {
            return fail(format!(
                "page tables hold {used_pages} pages, pool says {}",
                self.pool.num_used_pages()
            ));
        }
        if self.in_flight.is_none() {
            let prefilling = self.admitted.len() - self.num_running;
            if prefilling != usize::from(self.partial.is_some()) {
                return fail(format!(
                    "{prefilling} prefilling requests between iterations, partial {:?}",
                    self.partial
                ));
            }
        }
        Ok(())
    }
}
