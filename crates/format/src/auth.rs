//! Proof that a peer holds the shared token, without sending it: HMAC-SHA256 keyed with the
//! token over a label naming the use, and the nonces of one connection (node protocol §3,
//! monitor protocol §5). Bound to the nonces, a captured proof is worthless on the next
//! connection; bound to the label, a proof made for one use is worthless for another.

use hmac::Mac;

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// HMAC-SHA256 with `token` (its UTF-8 bytes) as key over `label`, a zero byte, `first`, a zero
/// byte and `second` (the nonces as the hex text they were sent as), in lowercase hex.
pub fn proof(token: &str, label: &str, first: &str, second: &str) -> String {
    mac(token, label, first, second)
        .finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Whether `given` is [`proof`] of these, compared in constant time. Anything that is not 64
/// hex digits is not.
pub fn proof_holds(token: &str, label: &str, first: &str, second: &str, given: &str) -> bool {
    let Some(bytes) = unhex(given) else {
        return false;
    };
    mac(token, label, first, second)
        .verify_slice(&bytes)
        .is_ok()
}

fn mac(token: &str, label: &str, first: &str, second: &str) -> HmacSha256 {
    let mut m =
        <HmacSha256 as Mac>::new_from_slice(token.as_bytes()).expect("HMAC takes any key length");
    for part in [
        label.as_bytes(),
        b"\0",
        first.as_bytes(),
        b"\0",
        second.as_bytes(),
    ] {
        m.update(part);
    }
    m
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() != 64 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_holds_only_for_its_token_its_label_and_its_nonces_in_order() {
        let p = proof("s3cret", "use", "a9e17", "c0ffee");
        assert_eq!(p.len(), 64);
        assert!(proof_holds("s3cret", "use", "a9e17", "c0ffee", &p));
        assert!(!proof_holds("secret", "use", "a9e17", "c0ffee", &p));
        assert!(!proof_holds("s3cret", "other use", "a9e17", "c0ffee", &p));
        assert!(!proof_holds("s3cret", "use", "c0ffee", "a9e17", &p));
        for junk in ["", "zz", &p[..63], &"g".repeat(64), &"f".repeat(1000)] {
            assert!(!proof_holds("s3cret", "use", "a9e17", "c0ffee", junk));
        }
    }
}
