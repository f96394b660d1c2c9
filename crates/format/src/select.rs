//! Predicates on an event record's header, for the monitor's station selections: a small
//! language an operator can type into a topology file or send to a running monitor, parsed once
//! and evaluated per event without allocating.
//!
//! ```text
//! predicate := clause ("||" clause)*
//! clause    := test ("&&" test)*
//! test      := field [("&" | "%") number] op number
//! field     := event_id | trigger_type | flags | size | fragments | missing | builder | timestamp
//! op        := "==" | "!=" | "<" | "<=" | ">" | ">="
//! number    := decimal, or hexadecimal with 0x
//! ```
//!
//! `&&` binds tighter than `||`; there are no parentheses. Examples: `event_id % 100 == 0`,
//! `flags & 1 != 0` (incomplete events), `trigger_type == 2 && size > 65536`.

use crate::event::EventRecordHeader;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Field {
    EventId,
    TriggerType,
    Flags,
    Size,
    Fragments,
    Missing,
    Builder,
    Timestamp,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Modifier {
    None,
    And(u64),
    Mod(u64),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Test {
    field: Field,
    modifier: Modifier,
    op: Op,
    value: u64,
}

/// A parsed predicate; see the module documentation for the language.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Predicate {
    /// Disjunction of conjunctions.
    clauses: Vec<Vec<Test>>,
    text: String,
}

/// Why a predicate does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("predicate {text:?}: {reason}")]
pub struct PredicateError {
    pub text: String,
    pub reason: String,
}

fn field(name: &str) -> Option<Field> {
    Some(match name {
        "event_id" => Field::EventId,
        "trigger_type" => Field::TriggerType,
        "flags" => Field::Flags,
        "size" => Field::Size,
        "fragments" => Field::Fragments,
        "missing" => Field::Missing,
        "builder" => Field::Builder,
        "timestamp" => Field::Timestamp,
        _ => return None,
    })
}

fn number(s: &str) -> Option<u64> {
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(&h.replace('_', ""), 16).ok(),
        None => s.replace('_', "").parse().ok(),
    }
}

/// Splits into words and operators: operators need no spaces around them.
fn tokens(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut chars = s.chars().peekable();
    let flush = |cur: &mut String, out: &mut Vec<String>| {
        if !cur.is_empty() {
            out.push(std::mem::take(cur));
        }
    };
    while let Some(c) = chars.next() {
        match c {
            c if c.is_whitespace() => flush(&mut cur, &mut out),
            '=' | '!' | '<' | '>' | '&' | '|' | '%' => {
                flush(&mut cur, &mut out);
                let mut op = c.to_string();
                if let Some(&n) = chars.peek() {
                    let pair = matches!(
                        (c, n),
                        ('=', '=') | ('!', '=') | ('<', '=') | ('>', '=') | ('&', '&') | ('|', '|')
                    );
                    if pair {
                        op.push(n);
                        chars.next();
                    }
                }
                out.push(op);
            }
            c => cur.push(c),
        }
    }
    flush(&mut cur, &mut out);
    out
}

impl Predicate {
    pub fn parse(text: &str) -> Result<Predicate, PredicateError> {
        let err = |reason: String| PredicateError {
            text: text.to_string(),
            reason,
        };
        let toks = tokens(text);
        if toks.is_empty() {
            return Err(err("empty".into()));
        }
        let mut clauses = vec![Vec::new()];
        let mut i = 0;
        loop {
            let name = toks
                .get(i)
                .ok_or_else(|| err("ends after a connective".into()))?;
            let f = field(name).ok_or_else(|| {
                err(format!(
                    "unknown field {name:?} (fields: event_id, trigger_type, flags, size, fragments, missing, builder, timestamp)"
                ))
            })?;
            i += 1;
            let mut modifier = Modifier::None;
            if let Some(m) = toks.get(i).filter(|t| *t == "&" || *t == "%") {
                let v = toks
                    .get(i + 1)
                    .and_then(|t| number(t))
                    .ok_or_else(|| err(format!("{m} needs a number")))?;
                modifier = if m == "&" {
                    Modifier::And(v)
                } else {
                    if v == 0 {
                        return Err(err("% 0".into()));
                    }
                    Modifier::Mod(v)
                };
                i += 2;
            }
            let op = match toks.get(i).map(String::as_str) {
                Some("==") => Op::Eq,
                Some("!=") => Op::Ne,
                Some("<") => Op::Lt,
                Some("<=") => Op::Le,
                Some(">") => Op::Gt,
                Some(">=") => Op::Ge,
                other => {
                    return Err(err(format!(
                        "expected a comparison after {name}, found {other:?}"
                    )))
                }
            };
            let value = toks
                .get(i + 1)
                .and_then(|t| number(t))
                .ok_or_else(|| err(format!("expected a number after the comparison of {name}")))?;
            i += 2;
            clauses.last_mut().expect("one clause").push(Test {
                field: f,
                modifier,
                op,
                value,
            });
            match toks.get(i).map(String::as_str) {
                None => break,
                Some("&&") | Some("and") => {}
                Some("||") | Some("or") => clauses.push(Vec::new()),
                Some(t) => return Err(err(format!("expected && or ||, found {t:?}"))),
            }
            i += 1;
        }
        Ok(Predicate {
            clauses,
            text: text.to_string(),
        })
    }

    /// The text it was parsed from.
    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn eval(&self, h: &EventRecordHeader) -> bool {
        self.clauses.iter().any(|c| c.iter().all(|t| t.eval(h)))
    }
}

impl Test {
    fn eval(&self, h: &EventRecordHeader) -> bool {
        let raw = match self.field {
            Field::EventId => h.event_id,
            Field::TriggerType => h.trigger_type as u64,
            Field::Flags => h.flags.0 as u64,
            Field::Size => h.record_size as u64,
            Field::Fragments => h.fragment_count as u64,
            Field::Missing => h.missing.len() as u64,
            Field::Builder => h.builder_id as u64,
            Field::Timestamp => h.timestamp,
        };
        let v = match self.modifier {
            Modifier::None => raw,
            Modifier::And(m) => raw & m,
            Modifier::Mod(m) => raw % m,
        };
        match self.op {
            Op::Eq => v == self.value,
            Op::Ne => v != self.value,
            Op::Lt => v < self.value,
            Op::Le => v <= self.value,
            Op::Gt => v > self.value,
            Op::Ge => v >= self.value,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::EventFlags;
    use proptest::prelude::*;

    fn header(event_id: u64, trigger_type: u16, flags: u32, size: u32) -> EventRecordHeader {
        EventRecordHeader {
            flags: EventFlags(flags),
            event_id,
            timestamp: 0,
            trigger_type,
            builder_id: 0,
            fragment_count: 3,
            record_size: size,
            missing: vec![],
            checksum: 0,
        }
    }

    #[test]
    fn the_documented_examples() {
        let p = Predicate::parse("event_id % 100 == 0").unwrap();
        assert!(p.eval(&header(300, 1, 0, 10)));
        assert!(!p.eval(&header(301, 1, 0, 10)));
        let p = Predicate::parse("flags & 1 != 0").unwrap();
        assert!(p.eval(&header(1, 1, 1, 10)));
        assert!(!p.eval(&header(1, 1, 8, 10)));
        let p = Predicate::parse("trigger_type == 2 && size > 65536").unwrap();
        assert!(p.eval(&header(1, 2, 0, 70000)));
        assert!(!p.eval(&header(1, 2, 0, 100)));
        assert!(!p.eval(&header(1, 1, 0, 70000)));
        let p = Predicate::parse("trigger_type==1||trigger_type==3").unwrap();
        assert!(p.eval(&header(1, 3, 0, 0)));
        assert!(!p.eval(&header(1, 2, 0, 0)));
        assert!(Predicate::parse("size >= 0x10")
            .unwrap()
            .eval(&header(0, 0, 0, 16)));
    }

    #[test]
    fn mistakes_are_named() {
        for (bad, says) in [
            ("", "empty"),
            ("colour == 1", "unknown field"),
            ("size 3", "expected a comparison"),
            ("size == ", "expected a number"),
            ("size == 1 &&", "ends after"),
            ("size == 1 size == 2", "expected && or ||"),
            ("event_id % 0 == 0", "% 0"),
        ] {
            let e = Predicate::parse(bad).unwrap_err();
            assert!(e.to_string().contains(says), "{bad:?}: {e}");
        }
    }

    proptest! {
        #[test]
        fn any_text_parses_or_errs_never_panics(s in "[a-z_ =!<>&|%0-9x]{0,40}") {
            if let Ok(p) = Predicate::parse(&s) {
                p.eval(&header(1, 2, 3, 4));
            }
        }

        #[test]
        fn modulo_selects_exactly_the_multiples(n in 1u64..50, id in any::<u64>()) {
            let p = Predicate::parse(&format!("event_id % {n} == 0")).unwrap();
            prop_assert_eq!(p.eval(&header(id, 0, 0, 0)), id % n == 0);
        }
    }
}
