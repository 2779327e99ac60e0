//! Parsing Kubernetes resource quantities (`500m`, `2`, `1.5Gi`, `1e3`) into the integer units nano-gpu
//! accounts in. Rounding is always up, as the scheduler rounds requests.

use thiserror::Error;

/// A quantity string that is not a Kubernetes quantity, or does not fit the unit asked for.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{text:?} is not a valid quantity: {why}")]
pub struct QuantityError {
    /// The text as given.
    pub text: String,
    /// What is wrong with it.
    pub why: &'static str,
}

/// A parsed quantity as an exact rational `mantissa × 10^exp10 × 2^exp2`.
struct Parsed {
    digits: u128,
    exp10: i32,
    exp2: u32,
}

fn parse(text: &str) -> Result<Parsed, QuantityError> {
    let err = |why| QuantityError { text: text.to_owned(), why };
    let s = text.trim();
    if s.is_empty() {
        return Err(err("empty"));
    }
    let s = s.strip_prefix('+').unwrap_or(s);
    if s.starts_with('-') {
        return Err(err("negative"));
    }
    let num_end = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (number, suffix) = s.split_at(num_end);
    if number.is_empty() || number == "." {
        return Err(err("no number"));
    }
    let (int_part, frac_part) = number.split_once('.').unwrap_or((number, ""));
    if frac_part.contains('.') {
        return Err(err("two decimal points"));
    }
    let mut digits: u128 = 0;
    for c in int_part.chars().chain(frac_part.chars()) {
        digits = digits
            .checked_mul(10)
            .and_then(|d| d.checked_add(u128::from(c as u8 - b'0')))
            .ok_or_else(|| err("too large"))?;
    }
    let mut exp10 = -(frac_part.len() as i32);
    let mut exp2 = 0;
    match suffix {
        "" => {}
        "m" => exp10 -= 3,
        "k" => exp10 += 3,
        "M" => exp10 += 6,
        "G" => exp10 += 9,
        "T" => exp10 += 12,
        "P" => exp10 += 15,
        "E" => exp10 += 18,
        "Ki" => exp2 = 10,
        "Mi" => exp2 = 20,
        "Gi" => exp2 = 30,
        "Ti" => exp2 = 40,
        "Pi" => exp2 = 50,
        "Ei" => exp2 = 60,
        other => {
            let exp = other
                .strip_prefix(['e', 'E'])
                .and_then(|e| e.parse::<i32>().ok())
                .filter(|e| e.abs() <= 30)
                .ok_or_else(|| err("unknown suffix"))?;
            exp10 += exp;
        }
    }
    Ok(Parsed { digits, exp10, exp2 })
}

/// `value × scale`, rounded up, as an integer; errors if it does not fit in a u64.
fn scaled_ceil(text: &str, scale_exp10: i32, divisor_exp2: u32) -> Result<u64, QuantityError> {
    let p = parse(text)?;
    let too_large = || QuantityError { text: text.to_owned(), why: "too large" };
    let exp10 = p.exp10 + scale_exp10;
    let mut num = p.digits;
    let mut den: u128 = 1;
    if exp10 >= 0 {
        num =
            num.checked_mul(10u128.checked_pow(exp10 as u32).ok_or_else(too_large)?).ok_or_else(too_large)?;
    } else {
        den = 10u128.checked_pow((-exp10) as u32).ok_or_else(too_large)?;
    }
    if p.exp2 >= divisor_exp2 {
        num = num.checked_mul(1u128 << (p.exp2 - divisor_exp2)).ok_or_else(too_large)?;
    } else {
        den = den.checked_mul(1u128 << (divisor_exp2 - p.exp2)).ok_or_else(too_large)?;
    }
    u64::try_from(num.div_ceil(den)).map_err(|_| too_large())
}

/// CPU quantity in millicores, rounded up (`"1.5"` → 1500, `"250m"` → 250).
pub fn cpu_milli(text: &str) -> Result<u64, QuantityError> {
    scaled_ceil(text, 3, 0)
}

/// Memory quantity in MiB, rounded up (`"1Gi"` → 1024, `"1G"` → 954).
pub fn mebibytes(text: &str) -> Result<u64, QuantityError> {
    scaled_ceil(text, 0, 20)
}

/// Memory quantity in bytes, rounded up (`"1Ki"` → 1024, `"1.5"` → 2).
pub fn bytes(text: &str) -> Result<u64, QuantityError> {
    scaled_ceil(text, 0, 0)
}

/// A count that must be a whole number (extended resources): `"30"` → 30; `"1.5"` and `"500m"` are errors.
pub fn whole(text: &str) -> Result<u64, QuantityError> {
    let milli = scaled_ceil(text, 3, 0)?;
    if milli % 1000 != 0 {
        return Err(QuantityError { text: text.to_owned(), why: "not a whole number" });
    }
    Ok(milli / 1000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_quantities_round_up_to_millicores() {
        assert_eq!(cpu_milli("250m"), Ok(250));
        assert_eq!(cpu_milli("1.5"), Ok(1500));
        assert_eq!(cpu_milli("2"), Ok(2000));
        assert_eq!(cpu_milli("0.0001"), Ok(1));
        assert_eq!(cpu_milli("1e3"), Ok(1_000_000));
    }

    #[test]
    fn memory_quantities_use_binary_and_decimal_suffixes() {
        assert_eq!(mebibytes("1Gi"), Ok(1024));
        assert_eq!(mebibytes("512Mi"), Ok(512));
        assert_eq!(mebibytes("1G"), Ok(954));
        assert_eq!(mebibytes("1"), Ok(1));
        assert_eq!(mebibytes("0"), Ok(0));
    }

    #[test]
    fn extended_resources_must_be_whole_numbers() {
        assert_eq!(whole("30"), Ok(30));
        assert_eq!(whole("1k"), Ok(1000));
        assert!(whole("1.5").unwrap_err().to_string().contains("not a whole number"));
        assert!(whole("500m").is_err());
    }

    #[test]
    fn malformed_quantities_say_what_is_wrong() {
        assert_eq!(whole("-1").unwrap_err().why, "negative");
        assert_eq!(whole("ten").unwrap_err().why, "no number");
        assert_eq!(whole("10x").unwrap_err().why, "unknown suffix");
        assert_eq!(whole("").unwrap_err().why, "empty");
        assert_eq!(whole("1.2.3").unwrap_err().why, "two decimal points");
        assert_eq!(whole("99999999999999999999999999999999999999999").unwrap_err().why, "too large");
    }
}
