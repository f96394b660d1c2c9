//! Setting keys of a topology's text before it is read (`tessera run --set KEY=VALUE`, the
//! points of `tessera scan`): the file's own text, comments and order kept, the value checked
//! by the same parse as any other.

/// The text of a topology with each `KEY=VALUE` of `sets` set, as [`set_key`] does.
pub fn apply(text: &str, sets: &[String]) -> Result<String, String> {
    if sets.is_empty() {
        return Ok(text.to_string());
    }
    let mut doc: toml_edit::DocumentMut = text.parse().map_err(|e| format!("{e}"))?;
    for s in sets {
        let (key, value) = s.split_once('=').ok_or_else(|| {
            format!("--set {s:?}: expected KEY=VALUE (e.g. monitor.listen=127.0.0.1:0)")
        })?;
        set_key(&mut doc, key.trim(), value.trim())?;
    }
    Ok(doc.to_string())
}

/// Sets `key` (dotted; `name[i]` picks the i-th of an array of tables, as `readout[0].host`) to
/// `value`, read as a TOML value (`4000`, `"veto"`, `true`, `[1, 2]`) or else as a string
/// (`16KiB`, `veto`). Missing tables are made; a missing array entry is an error.
pub fn set_key(doc: &mut toml_edit::DocumentMut, key: &str, value: &str) -> Result<(), String> {
    let segments: Vec<&str> = key.split('.').collect();
    if segments.iter().any(|s| s.is_empty()) {
        return Err(format!("{key}: an empty part in the key"));
    }
    let mut table: &mut toml_edit::Table = doc.as_table_mut();
    for (i, seg) in segments.iter().enumerate() {
        let (name, index) = split_index(seg).map_err(|e| format!("{key}: {e}"))?;
        let last = i + 1 == segments.len();
        match index {
            Some(k) => {
                let len = table
                    .get(name)
                    .and_then(|it| it.as_array_of_tables())
                    .map(|a| a.len())
                    .unwrap_or(0);
                if k >= len {
                    return Err(format!(
                        "{key}: the configuration has {len} [[{name}]] entries, no [{k}]"
                    ));
                }
                if last {
                    return Err(format!("{key}: names a whole [[{name}]] entry, not a key"));
                }
                table = table
                    .get_mut(name)
                    .and_then(|it| it.as_array_of_tables_mut())
                    .and_then(|a| a.get_mut(k))
                    .expect("checked above");
            }
            None if last => {
                table.insert(name, toml_edit::Item::Value(parse_value(value)));
            }
            None => {
                let item = table
                    .entry(name)
                    .or_insert_with(|| toml_edit::Item::Table(toml_edit::Table::new()));
                if let Some(t) = item.as_inline_table() {
                    // `sources = { count = 8 }` becomes a plain table, so keys can go in it.
                    *item = toml_edit::Item::Table(t.clone().into_table());
                }
                table = item
                    .as_table_mut()
                    .ok_or_else(|| format!("{key}: {name} is a value, not a table"))?;
            }
        }
    }
    Ok(())
}

fn split_index(seg: &str) -> Result<(&str, Option<usize>), String> {
    match seg.split_once('[') {
        None => Ok((seg, None)),
        Some((name, rest)) => {
            let k = rest
                .strip_suffix(']')
                .and_then(|n| n.parse::<usize>().ok())
                .ok_or_else(|| format!("{seg:?}: expected name[index]"))?;
            Ok((name, Some(k)))
        }
    }
}

fn parse_value(value: &str) -> toml_edit::Value {
    value
        .parse::<toml_edit::Value>()
        .unwrap_or_else(|_| toml_edit::Value::from(value))
}
