//! Byte sizes written as integers (bytes) or strings with a unit ("64 MiB", "16k", "1.5 GB").

use serde::{de, Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// A number of bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl ByteSize {
    pub fn parse(s: &str) -> Result<ByteSize, String> {
        let t = s.trim();
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let n: f64 = num
            .parse()
            .map_err(|_| format!("`{s}` is not a size (like 4096, \"16 KiB\", \"64MiB\")"))?;
        let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kib" => 1 << 10,
            "kb" => 1000,
            "m" | "mib" => 1 << 20,
            "mb" => 1_000_000,
            "g" | "gib" => 1 << 30,
            "gb" => 1_000_000_000,
            "t" | "tib" => 1 << 40,
            "tb" => 1_000_000_000_000,
            u => {
                return Err(format!(
                    "unknown size unit `{u}` in `{s}` (B, KiB, MiB, GiB, TiB, kB, MB, GB, TB)"
                ))
            }
        };
        let v = n * mult as f64;
        if !(v.is_finite() && v >= 0.0 && v < u64::MAX as f64) {
            return Err(format!("`{s}` is out of range"));
        }
        Ok(ByteSize(v.round() as u64))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v = self.0;
        for (unit, m) in [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)] {
            if v >= m {
                return if v.is_multiple_of(m) {
                    write!(f, "{} {unit}", v / m)
                } else {
                    write!(f, "{:.1} {unit}", v as f64 / m as f64)
                };
            }
        }
        write!(f, "{v} B")
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a size in bytes, or a string like \"16 KiB\"")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v)
                    .map(ByteSize)
                    .map_err(|_| E::custom("a size cannot be negative"))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteSize, E> {
                ByteSize::parse(v).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::ByteSize;

    #[test]
    fn parses_units() {
        assert_eq!(ByteSize::parse("4096").unwrap().0, 4096);
        assert_eq!(ByteSize::parse("16 KiB").unwrap().0, 16384);
        assert_eq!(ByteSize::parse("1.5MB").unwrap().0, 1_500_000);
        assert!(ByteSize::parse("3 furlongs").is_err());
        assert_eq!(ByteSize(64 << 20).to_string(), "64 MiB");
    }
}
