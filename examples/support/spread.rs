//! The spread of a measurement's samples: the fewest, the median and the most, which every
//! benchmark row carries beside its figure.

/// The fewest, median and most of the samples of one measurement, in its unit.
///
/// The median of an even number of samples is the upper of the two middle ones, so that it
/// is always a value that was measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spread {
    /// The fewest.
    pub min: f64,
    /// The median.
    pub median: f64,
    /// The most.
    pub max: f64,
}

impl Spread {
    /// The spread of `samples`, which it sorts; `None` when there are none.
    pub fn of(samples: &mut [f64]) -> Option<Spread> {
        samples.sort_by(f64::total_cmp);
        let (&min, &max) = (samples.first()?, samples.last()?);
        Some(Spread { min, median: samples[samples.len() / 2], max })
    }

    /// A figure known once (no repetitions): all three are `value`.
    pub fn exact(value: f64) -> Spread {
        Spread { min: value, median: value, max: value }
    }

    /// Seconds spent moving `amount` as a rate, `amount` per second: the fewest seconds are
    /// the highest rate, so `min` and `max` trade places.
    pub fn per_second(self, amount: f64) -> Spread {
        Spread { min: amount / self.max, median: amount / self.median, max: amount / self.min }
    }
}

#[cfg(test)]
mod tests {
    use super::Spread;

    #[test]
    fn odd_and_even_counts_give_a_measured_median() {
        let odd = Spread::of(&mut [5.0, 1.0, 9.0, 7.0, 2.0]).unwrap();
        assert_eq!(odd, Spread { min: 1.0, median: 5.0, max: 9.0 });
        let even = Spread::of(&mut [4.0, 1.0, 3.0, 2.0]).unwrap();
        assert_eq!(even, Spread { min: 1.0, median: 3.0, max: 4.0 }, "the upper middle value");
        assert_eq!(Spread::of(&mut [2.5]), Some(Spread::exact(2.5)));
        assert_eq!(Spread::of(&mut []), None);
    }

    #[test]
    fn seconds_become_rates_with_min_and_max_swapped() {
        let secs = Spread { min: 0.5, median: 1.0, max: 2.0 };
        assert_eq!(secs.per_second(10.0), Spread { min: 5.0, median: 10.0, max: 20.0 });
    }
}
