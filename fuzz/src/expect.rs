//! What a call must return, tracked while its input is decoded.

use std::fmt::Debug;

/// The verdict a call must reach. Each deliberate fault the decoder introduces is recorded;
/// so is any doubt (wild sizes, free output strides), which permits either outcome.
#[derive(Clone, Debug, Default)]
pub struct Expect {
    faults: Vec<&'static str>,
    unsure: Vec<&'static str>,
}

impl Expect {
    /// The input breaks the contract: the call must fail.
    pub fn fault(&mut self, why: &'static str) {
        self.faults.push(why);
    }

    /// The input may be valid or not: either outcome is fine (it still must not panic).
    pub fn unsure(&mut self, why: &'static str) {
        self.unsure.push(why);
    }

    /// Whether the fault `why` was recorded.
    pub fn has(&self, why: &str) -> bool {
        self.faults.contains(&why)
    }

    /// Whether the decoder introduced no fault.
    pub fn is_valid(&self) -> bool {
        self.faults.is_empty()
    }

    /// Whether the call must succeed.
    pub fn must_succeed(&self) -> bool {
        self.faults.is_empty() && self.unsure.is_empty()
    }

    /// Panics if `res` contradicts the expectation.
    pub fn check<T, E: Debug>(&self, what: &str, res: &Result<T, E>) {
        match res {
            Ok(_) if !self.faults.is_empty() => {
                panic!("{what} accepted an invalid input: {:?}", self.faults)
            }
            Err(e) if self.must_succeed() => panic!("{what} refused a valid input: {e:?}"),
            _ => {}
        }
    }
}
