//! Sizes as people write them: [`parse`] reads the size flags (`4096`, `4KiB`, `1 GiB`) and
//! [`human`] prints a size the same way (`4 KiB`).

/// The forms a size flag accepts, as a usage error says them.
pub(crate) const FORMS: &str =
    "bytes (4096) or a whole number of B, KiB, MiB or GiB (256B, 4KiB, 1MiB, 1GiB; binary units)";

/// `s` in bytes: a whole number, optionally followed by `B`, `KiB`, `MiB` or `GiB` (any
/// case, a space allowed before the unit). Decimal or one-letter units (`4k`, `1MB`) are
/// refused rather than guessed at.
pub(crate) fn parse(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = (&s[..split], s[split..].trim_start());
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "kib" => 10,
        "mib" => 20,
        "gib" => 30,
        _ => return Err(format!("expected {FORMS}")),
    };
    let n: u64 = digits.parse().map_err(|_| format!("expected {FORMS}"))?;
    n.checked_mul(1 << shift).ok_or_else(|| format!("{s} is too large; expected {FORMS}"))
}

/// A size flag's value of at least one byte.
pub(crate) fn positive(s: &str) -> Result<usize, String> {
    match usize::try_from(parse(s)?) {
        Ok(0) => Err(format!("it must be at least 1 byte; expected {FORMS}")),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{s} is too large for this machine")),
    }
}

/// `bytes` as people write it: `4 KiB`, `1 GiB`, `100 B`.
pub(crate) fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::{human, parse, positive};

    #[test]
    fn sizes_parse_with_binary_units_and_print_back() {
        for (text, bytes) in [
            ("256", 256),
            ("256B", 256),
            ("4KiB", 4096),
            ("4kib", 4096),
            ("4 KiB", 4096),
            ("1MiB", 1 << 20),
            ("1GiB", 1 << 30),
            ("1073741824", 1 << 30),
            ("0", 0),
        ] {
            assert_eq!(parse(text), Ok(bytes), "{text}");
        }
        for bad in ["", "4k", "1MB", "1.5GiB", "-1", "KiB", "4 TiB", "99999999999GiB"] {
            let e = parse(bad).expect_err(bad);
            assert!(e.contains("KiB"), "{bad}: says the accepted forms: {e}");
        }
        assert!(positive("0").is_err() && positive("0KiB").is_err());
        assert_eq!(positive("64KiB"), Ok(65536));
        for (bytes, text) in [(4, "4 B"), (4096, "4 KiB"), (6144, "6 KiB"), (1000, "1000 B")] {
            assert_eq!(human(bytes), text);
        }
        assert_eq!(human(1 << 20), "1 MiB");
        assert_eq!(human(1 << 30), "1 GiB");
        assert_eq!(human(3 << 29), "1536 MiB");
        for n in [1usize, 256, 4096, 65536, 1 << 20, 1 << 30] {
            assert_eq!(parse(&human(n)), Ok(n as u64), "what is printed parses back");
        }
    }
}
