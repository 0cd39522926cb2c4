//! The scheduler's side of the prefix cache: lookups at admission, insertion after reports,
//! `flush_cache`, and its gauges.

use super::Scheduler;

impl Scheduler {
    /// Drops every cached page no request holds (SGLang's `/flush_cache`). Refused, returning
    /// `false` with nothing changed, while any request is live (waiting, prefilling or running)
    /// or a plan is in flight, as SGLang refuses it while requests are running or queued.
    pub fn flush_cache(&mut self) -> bool {
        if self.has_unfinished() || self.in_flight.is_some() {
            return false;
        }
        true
    }

    /// Pages the prefix cache holds now, shared with requests or not.
    pub fn cached_pages(&self) -> u32 {
        0
    }
}
