//! A tiny JSON reader for policy definitions (objects, strings, integers, booleans, arrays)
//! and a writer for `warrenctl --formatter json`. No floats, no `null`: RabbitMQ policy keys
//! never take them, so they are refused with a clear message.

use std::collections::BTreeMap;

use crate::meta::policy::PolicyValue;

/// Why a JSON text was refused; `at` is the byte offset.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid JSON at byte {at}: {reason}")]
pub struct JsonError {
    /// Byte offset of the problem.
    pub at: usize,
    /// What was wrong.
    pub reason: String,
}

struct Parser<'a> {
    s: &'a [u8],
    pos: usize,
    depth: usize,
}

const MAX_DEPTH: usize = 32;

impl Parser<'_> {
    fn err<T>(&self, reason: impl Into<String>) -> Result<T, JsonError> {
        Err(JsonError {
            at: self.pos,
            reason: reason.into(),
        })
    }

    fn ws(&mut self) {
        while self.pos < self.s.len() && matches!(self.s[self.pos], b' ' | b'\t' | b'\n' | b'\r') {
            self.pos += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.pos).copied()
    }

    fn expect(&mut self, c: u8) -> Result<(), JsonError> {
        self.ws();
        if self.peek() == Some(c) {
            self.pos += 1;
            Ok(())
        } else {
            self.err(format!("expected '{}'", c as char))
        }
    }

    fn value(&mut self) -> Result<PolicyValue, JsonError> {
        self.ws();
        match self.peek() {
            None => self.err("unexpected end of input"),
            Some(b'"') => Ok(PolicyValue::Str(self.string()?)),
            Some(b'[') => {
                self.depth += 1;
                if self.depth > MAX_DEPTH {
                    return self.err("nested too deeply");
                }
                self.pos += 1;
                let mut items = Vec::new();
                self.ws();
                if self.peek() == Some(b']') {
                    self.pos += 1;
                } else {
                    loop {
                        items.push(self.value()?);
                        self.ws();
                        match self.peek() {
                            Some(b',') => self.pos += 1,
                            Some(b']') => {
                                self.pos += 1;
                                break;
                            }
                            _ => return self.err("expected ',' or ']'"),
                        }
                    }
                }
                self.depth -= 1;
                Ok(PolicyValue::List(items))
            }
            Some(b'{') => self.err("nested objects are not supported in a policy value"),
            Some(b't') => self.word("true", PolicyValue::Bool(true)),
            Some(b'f') => self.word("false", PolicyValue::Bool(false)),
            Some(b'n') => self.err("null is not a valid policy value"),
            Some(c) if c == b'-' || c.is_ascii_digit() => self.number(),
            Some(c) => self.err(format!("unexpected character '{}'", c as char)),
        }
    }

    fn word(&mut self, w: &str, v: PolicyValue) -> Result<PolicyValue, JsonError> {
        if self.s[self.pos..].starts_with(w.as_bytes()) {
            self.pos += w.len();
            Ok(v)
        } else {
            self.err("unknown literal (expected true or false)")
        }
    }

    fn number(&mut self) -> Result<PolicyValue, JsonError> {
        let start = self.pos;
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.pos += 1;
        }
        if matches!(self.peek(), Some(b'.' | b'e' | b'E')) {
            return self.err("only integers are supported");
        }
        let text = std::str::from_utf8(&self.s[start..self.pos]).unwrap_or("");
        match text.parse::<i64>() {
            Ok(n) => Ok(PolicyValue::Int(n)),
            Err(_) => Err(JsonError {
                at: start,
                reason: format!("'{text}' is not a valid integer"),
            }),
        }
    }

    fn string(&mut self) -> Result<String, JsonError> {
        self.ws();
        if self.peek() != Some(b'"') {
            return self.err("expected a string");
        }
        self.pos += 1;
        let mut out = Vec::new();
        loop {
            let Some(c) = self.peek() else {
                return self.err("unterminated string");
            };
            self.pos += 1;
            match c {
                b'"' => break,
                b'\\' => {
                    let Some(e) = self.peek() else {
                        return self.err("unterminated escape");
                    };
                    self.pos += 1;
                    match e {
                        b'"' => out.push(b'"'),
                        b'\\' => out.push(b'\\'),
                        b'/' => out.push(b'/'),
                        b'b' => out.push(8),
                        b'f' => out.push(12),
                        b'n' => out.push(b'\n'),
                        b'r' => out.push(b'\r'),
                        b't' => out.push(b'\t'),
                        b'u' => {
                            let hex = self
                                .s
                                .get(self.pos..self.pos + 4)
                                .and_then(|h| std::str::from_utf8(h).ok())
                                .and_then(|h| u32::from_str_radix(h, 16).ok());
                            let Some(code) = hex else {
                                return self.err("bad \\u escape");
                            };
                            self.pos += 4;
                            let ch = char::from_u32(code).unwrap_or('\u{FFFD}');
                            let mut buf = [0u8; 4];
                            out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                        }
                        _ => return self.err("unknown escape"),
                    }
                }
                c if c < 0x20 => return self.err("control character in string"),
                c => out.push(c),
            }
        }
        String::from_utf8(out).or_else(|_| self.err("string is not UTF-8"))
    }
}

/// Parses a policy definition: a JSON object whose values are strings, integers, booleans or
/// arrays of those.
pub fn parse_definition(text: &str) -> Result<BTreeMap<String, PolicyValue>, JsonError> {
    let mut p = Parser {
        s: text.as_bytes(),
        pos: 0,
        depth: 0,
    };
    p.expect(b'{')?;
    let mut map = BTreeMap::new();
    p.ws();
    if p.peek() == Some(b'}') {
        p.pos += 1;
    } else {
        loop {
            let key = p.string()?;
            p.expect(b':')?;
            let v = p.value()?;
            if map.insert(key.clone(), v).is_some() {
                return p.err(format!("duplicate key '{key}'"));
            }
            p.ws();
            match p.peek() {
                Some(b',') => p.pos += 1,
                Some(b'}') => {
                    p.pos += 1;
                    break;
                }
                _ => return p.err("expected ',' or '}'"),
            }
        }
    }
    p.ws();
    if p.pos != p.s.len() {
        return p.err("trailing characters after the object");
    }
    Ok(map)
}

/// Writes `s` as a JSON string.
pub fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Writes a policy value as JSON.
pub fn write_value(v: &PolicyValue) -> String {
    match v {
        PolicyValue::Int(n) => n.to_string(),
        PolicyValue::Str(s) => quote(s),
        PolicyValue::Bool(b) => b.to_string(),
        PolicyValue::List(items) => {
            let inner: Vec<String> = items.iter().map(write_value).collect();
            format!("[{}]", inner.join(","))
        }
    }
}

/// Writes a definition as a JSON object.
pub fn write_definition(def: &BTreeMap<String, PolicyValue>) -> String {
    let inner: Vec<String> = def
        .iter()
        .map(|(k, v)| format!("{}:{}", quote(k), write_value(v)))
        .collect();
    format!("{{{}}}", inner.join(","))
}

/// Writes a table as a JSON array of objects, every value a string.
pub fn write_rows(columns: &[String], rows: &[Vec<String>]) -> String {
    let objs: Vec<String> = rows
        .iter()
        .map(|r| {
            let fields: Vec<String> = columns
                .iter()
                .zip(r)
                .map(|(c, v)| format!("{}:{}", quote(c), quote(v)))
                .collect();
            format!("{{{}}}", fields.join(","))
        })
        .collect();
    format!("[{}]", objs.join(",\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_definitions() {
        let d = parse_definition(
            r#" {"max-length": 10, "overflow":"drop-head", "x":[1,"a",true], "e\"":false} "#,
        )
        .unwrap();
        assert_eq!(d["max-length"], PolicyValue::Int(10));
        assert_eq!(d["overflow"], PolicyValue::Str("drop-head".into()));
        assert_eq!(
            d["x"],
            PolicyValue::List(vec![
                PolicyValue::Int(1),
                PolicyValue::Str("a".into()),
                PolicyValue::Bool(true)
            ])
        );
        assert_eq!(d["e\""], PolicyValue::Bool(false));
        assert_eq!(parse_definition(&write_definition(&d)).unwrap(), d);
    }

    #[test]
    fn refuses_bad_json() {
        for bad in [
            "",
            "{",
            "[1]",
            "{\"a\":1,}",
            "{\"a\":1.5}",
            "{\"a\":null}",
            "{\"a\":1} x",
            "{a:1}",
            "{\"a\":\"x}",
            "{\"a\":99999999999999999999}",
            "{\"a\":1,\"a\":2}",
        ] {
            assert!(parse_definition(bad).is_err(), "{bad}");
        }
    }
}
