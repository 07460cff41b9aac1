//! Listing parameters as RabbitMQ's management API takes them (`rabbit_mgmt_util`):
//! `columns` (keep only these fields; a dotted name keeps its top-level field, as 3.10
//! does), `sort` / `sort_reverse`, and pagination — `page`, `page_size` (default 100, at
//! most 500), `name` (a case-insensitive substring, or with `use_regex=true` a
//! case-insensitive regular expression, searched in the object's `name`). A paginated
//! answer is an object with the page and the counts around it; the name filter applies only
//! with `page`, as in RabbitMQ. The parameters shape any [`Listed`] objects: JSON values,
//! or the queue objects a listing writes as text ([`write_shaped`]).

use regex::RegexBuilder;
use serde_json::{Map, Value};

use super::{Request, Response};

const DEFAULT_PAGE_SIZE: u64 = 100;
const MAX_PAGE_SIZE: u64 = 500;

/// The listing parameters of one request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ListQuery {
    columns: Option<Vec<String>>,
    sort: Option<String>,
    sort_reverse: bool,
    page: Option<Page>,
}

#[derive(Clone, Debug, PartialEq)]
struct Page {
    number: u64,
    size: u64,
    name: Option<String>,
    use_regex: bool,
}

impl ListQuery {
    /// The parameters of `req`; 400 with RabbitMQ's texts for bad pagination.
    pub fn parse(req: &Request) -> Result<ListQuery, Response> {
        let columns = req.query_value("columns").map(|c| {
            c.split(',')
                .map(str::trim)
                .filter(|c| !c.is_empty())
                .map(|c| c.split('.').next().unwrap_or(c).to_string())
                .collect()
        });
        let page = match req.query_value("page") {
            None => None,
            Some(p) => {
                let bad = || Response::bad_request("Pagination parameters are invalid");
                let number: u64 = p.parse().map_err(|_| bad())?;
                let size: Option<u64> = match req.query_value("page_size") {
                    None => None,
                    Some(s) => Some(s.parse().map_err(|_| bad())?),
                };
                let size_text = size.map_or("undefined".to_string(), |s| s.to_string());
                let size_ok = size.unwrap_or(DEFAULT_PAGE_SIZE);
                if number == 0 || size_ok == 0 || size_ok > MAX_PAGE_SIZE {
                    return Err(Response::error(
                        400,
                        "invalid_pagination_parameters",
                        format!(
                            "Invalid pagination parameters: page number {number}, page size {size_text}"
                        ),
                    ));
                }
                Some(Page {
                    number,
                    size: size_ok,
                    name: req.query_value("name").filter(|n| !n.is_empty()),
                    use_regex: req.query_value("use_regex").as_deref() == Some("true"),
                })
            }
        };
        Ok(ListQuery {
            columns,
            sort: req.query_value("sort").filter(|s| !s.is_empty()),
            sort_reverse: req.query_value("sort_reverse").as_deref() == Some("true"),
            page,
        })
    }

    /// Whether the request asks for nothing of this (the body goes out as it is).
    pub fn is_plain(&self) -> bool {
        *self == ListQuery::default()
    }

    /// The columns asked for, if any.
    pub fn columns(&self) -> Option<&[String]> {
        self.columns.as_deref()
    }

    /// `body` (a listing, or one object) as the parameters shape it.
    pub fn apply(&self, body: Value) -> Result<Value, Response> {
        let Value::Array(items) = body else {
            return Ok(self.select(body));
        };
        let shaped = self.shape(items)?;
        let items: Vec<Value> = shaped.items.into_iter().map(|i| self.select(i)).collect();
        Ok(match shaped.page {
            None => Value::Array(items),
            Some(page) => {
                let mut o: Map<String, Value> = page
                    .counts(items.len())
                    .into_iter()
                    .map(|(k, n)| (k.to_string(), Value::from(n)))
                    .collect();
                o.insert("items".to_string(), Value::Array(items));
                Value::Object(o)
            }
        })
    }

    /// The objects of a listing sorted, filtered and cut to the page the parameters ask
    /// for (the columns are left to the caller).
    pub fn shape<T: Listed>(&self, mut items: Vec<T>) -> Result<Shaped<T>, Response> {
        if let Some(key) = &self.sort {
            // Each item's key looked up once, not at every comparison (an object is a map
            // of some forty fields: 10,000 queues made the lookups most of a listing's time).
            let keys: Vec<Option<Value>> = items.iter().map(|i| i.field(key)).collect();
            let mut order: Vec<usize> = (0..items.len()).collect();
            order.sort_by(|&a, &b| compare(keys[a].as_ref(), keys[b].as_ref()));
            let mut slots: Vec<Option<T>> = items.into_iter().map(Some).collect();
            items = order.into_iter().filter_map(|i| slots[i].take()).collect();
            if self.sort_reverse {
                items.reverse();
            }
        }
        let Some(page) = &self.page else {
            return Ok(Shaped { items, page: None });
        };
        let total = items.len() as u64;
        if let Some(name) = &page.name {
            let matches = name_filter(name, page.use_regex)?;
            items.retain(|i| i.name().is_some_and(&matches));
        }
        let filtered = items.len() as u64;
        let page_count = filtered.div_ceil(page.size).max(1);
        if page.number > page_count {
            return Err(Response::error(
                400,
                "page_out_of_range",
                format!(
                    "Page out of range, page: {} page size: {}, len: {filtered}",
                    page.number, page.size
                ),
            ));
        }
        let start = ((page.number - 1) * page.size) as usize;
        let items = items
            .into_iter()
            .skip(start)
            .take(page.size as usize)
            .collect();
        Ok(Shaped {
            items,
            page: Some(PageCounts {
                filtered,
                total,
                page: page.number,
                page_count,
                page_size: page.size,
            }),
        })
    }

    /// One object with only the requested columns.
    fn select(&self, item: Value) -> Value {
        match (&self.columns, item) {
            (Some(cols), Value::Object(map)) => {
                let kept: Map<String, Value> = map
                    .into_iter()
                    .filter(|(k, _)| cols.iter().any(|c| c == k))
                    .collect();
                Value::Object(kept)
            }
            (_, item) => item,
        }
    }
}

/// What the listing parameters read of a listed object.
pub trait Listed {
    /// Its field `key` (a sort key), if it has one.
    fn field(&self, key: &str) -> Option<Value>;
    /// Its `name`, for the name filter.
    fn name(&self) -> Option<&str>;
}

impl Listed for Value {
    fn field(&self, key: &str) -> Option<Value> {
        self.get(key).cloned()
    }

    fn name(&self) -> Option<&str> {
        self.get("name").and_then(Value::as_str)
    }
}

/// A listing as the parameters shape it ([`ListQuery::shape`]).
pub struct Shaped<T> {
    /// The objects shown, in order.
    pub items: Vec<T>,
    /// With `page`: the counts around them.
    pub page: Option<PageCounts>,
}

/// The counts a paginated answer carries beside its `items`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageCounts {
    filtered: u64,
    total: u64,
    page: u64,
    page_count: u64,
    page_size: u64,
}

impl PageCounts {
    /// The answer's members other than `items` (whose length is `item_count`), in
    /// RabbitMQ's order.
    pub fn counts(&self, item_count: usize) -> [(&'static str, u64); 6] {
        [
            ("filtered_count", self.filtered),
            ("item_count", item_count as u64),
            ("page", self.page),
            ("page_count", self.page_count),
            ("page_size", self.page_size),
            ("total_count", self.total),
        ]
    }
}

/// Writes a shaped listing as JSON text: its objects (each by `write_item`) as an array,
/// or with `page` the paginated object around them.
pub fn write_shaped<T>(
    shaped: &Shaped<T>,
    out: &mut Vec<u8>,
    mut write_item: impl FnMut(&T, &mut Vec<u8>),
) {
    let mut items = |out: &mut Vec<u8>| {
        out.push(b'[');
        for (i, item) in shaped.items.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            write_item(item, out);
        }
        out.push(b']');
    };
    let Some(page) = &shaped.page else {
        items(out);
        return;
    };
    out.push(b'{');
    for (k, n) in page.counts(shaped.items.len()) {
        write_str(out, k);
        out.push(b':');
        write_u64(out, n);
        out.push(b',');
    }
    out.extend_from_slice(b"\"items\":");
    items(out);
    out.push(b'}');
}

/// Writes `s` as a JSON string.
pub fn write_str(out: &mut Vec<u8>, s: &str) {
    // Writing into a vector cannot fail, and a string always serializes.
    let _ = serde_json::to_writer(out, s);
}

/// Writes `n` as a JSON number.
pub fn write_u64(out: &mut Vec<u8>, n: u64) {
    use std::io::Write;
    // As above: a vector takes every write.
    let _ = write!(out, "{n}");
}

/// Writes `v` as JSON text.
pub fn write_json(out: &mut Vec<u8>, v: &Value) {
    // As above: a value's keys are strings, and a vector takes every write.
    let _ = serde_json::to_writer(out, v);
}

/// The name filter: a case-insensitive substring, or regular expression.
fn name_filter(name: &str, use_regex: bool) -> Result<impl Fn(&str) -> bool, Response> {
    let pattern = if use_regex {
        name.to_string()
    } else {
        regex::escape(name)
    };
    let re = RegexBuilder::new(&pattern)
        .case_insensitive(true)
        .build()
        .map_err(|e| Response::bad_request(format!("invalid regular expression: {e}")))?;
    Ok(move |s: &str| re.is_match(s))
}

/// Orders JSON values: missing and null first, then booleans, numbers, strings, others.
fn compare(a: Option<&Value>, b: Option<&Value>) -> std::cmp::Ordering {
    fn rank(v: Option<&Value>) -> u8 {
        match v {
            None | Some(Value::Null) => 0,
            Some(Value::Bool(_)) => 1,
            Some(Value::Number(_)) => 2,
            Some(Value::String(_)) => 3,
            Some(_) => 4,
        }
    }
    match (a, b) {
        (Some(Value::Bool(x)), Some(Value::Bool(y))) => x.cmp(y),
        (Some(Value::Number(x)), Some(Value::Number(y))) => {
            let (x, y) = (x.as_f64().unwrap_or(0.0), y.as_f64().unwrap_or(0.0));
            x.partial_cmp(&y).unwrap_or(std::cmp::Ordering::Equal)
        }
        (Some(Value::String(x)), Some(Value::String(y))) => x.cmp(y),
        _ => rank(a).cmp(&rank(b)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mgmt::Method;
    use proptest::prelude::*;
    use serde_json::json;

    fn q(query: &str) -> Result<ListQuery, Response> {
        ListQuery::parse(&Request::new(
            Method::Get,
            &format!("/api/queues?{query}"),
            None,
        ))
    }

    fn names(v: &[&str]) -> Value {
        Value::Array(
            v.iter()
                .map(|n| json!({"name": n, "messages": n.len(), "vhost": "/"}))
                .collect(),
        )
    }

    const QUEUES: &[&str] = &["aliveness-test", "alpha", "alphabet", "beta", "gamma"];

    #[test]
    fn pages_carry_rabbitmqs_counts() {
        // The answers a live RabbitMQ 3.10.8 gave for the same five queues.
        let r = q("page=1&page_size=2&name=alpha&columns=name")
            .unwrap()
            .apply(names(QUEUES))
            .unwrap();
        assert_eq!(
            r,
            json!({"filtered_count":2,"item_count":2,"items":[{"name":"alpha"},{"name":"alphabet"}],
                   "page":1,"page_count":1,"page_size":2,"total_count":5})
        );
        let r = q("page=2&page_size=2&columns=name&sort=name&sort_reverse=true")
            .unwrap()
            .apply(names(QUEUES))
            .unwrap();
        assert_eq!(
            r,
            json!({"filtered_count":5,"item_count":2,"items":[{"name":"alphabet"},{"name":"alpha"}],
                   "page":2,"page_count":3,"page_size":2,"total_count":5})
        );
        let r = q("page=1&page_size=2&name=%5Eal.*t&use_regex=true&columns=name")
            .unwrap()
            .apply(names(QUEUES))
            .unwrap();
        assert_eq!(
            r["items"],
            json!([{"name":"aliveness-test"},{"name":"alphabet"}])
        );
        let r = q("page=1&name=ALPHA&columns=name")
            .unwrap()
            .apply(names(QUEUES))
            .unwrap();
        assert_eq!(
            (r["filtered_count"].clone(), r["page_size"].clone()),
            (json!(2), json!(100))
        );
    }

    #[test]
    fn bad_pages_answer_400_with_rabbitmqs_texts() {
        let e = q("page=9&page_size=2")
            .unwrap()
            .apply(names(QUEUES))
            .unwrap_err();
        assert_eq!(
            e.body,
            Some(
                json!({"error":"page_out_of_range","reason":"Page out of range, page: 9 page size: 2, len: 5"})
            )
        );
        let e = q("page=1&page_size=1000").unwrap_err();
        assert_eq!(
            e.body,
            Some(json!({"error":"invalid_pagination_parameters",
                        "reason":"Invalid pagination parameters: page number 1, page size 1000"}))
        );
        let e = q("page=0").unwrap_err();
        assert_eq!(
            e.body.unwrap()["reason"],
            "Invalid pagination parameters: page number 0, page size undefined"
        );
        let e = q("page=x").unwrap_err();
        assert_eq!(
            e.body,
            Some(json!({"error":"bad_request","reason":"Pagination parameters are invalid"}))
        );
    }

    #[test]
    fn without_a_page_the_name_is_ignored_and_columns_still_apply() {
        let r = q("name=alpha&columns=name,vhost")
            .unwrap()
            .apply(names(QUEUES))
            .unwrap();
        assert_eq!(r.as_array().unwrap().len(), 5);
        assert_eq!(r[0], json!({"name": "aliveness-test", "vhost": "/"}));
        // One object: columns only.
        let r = q("columns=name")
            .unwrap()
            .apply(json!({"name": "a", "x": 1}))
            .unwrap();
        assert_eq!(r, json!({"name": "a"}));
        // A dotted column keeps its top-level field, as RabbitMQ 3.10 does.
        let r = q("columns=backing_queue_status.mode")
            .unwrap()
            .apply(json!({"name": "a", "backing_queue_status": {"mode": "lazy", "len": 1}}))
            .unwrap();
        assert_eq!(
            r,
            json!({"backing_queue_status": {"mode": "lazy", "len": 1}})
        );
        assert!(q("").unwrap().is_plain());
    }

    #[test]
    fn numbers_sort_as_numbers() {
        let r = q("sort=messages&columns=name")
            .unwrap()
            .apply(json!([{"name":"a","messages":10},{"name":"b","messages":9},{"name":"c"}]))
            .unwrap();
        assert_eq!(r, json!([{"name":"c"},{"name":"b"},{"name":"a"}]));
    }

    proptest! {
        /// Walking every page shows each matching item exactly once, in order.
        #[test]
        fn pages_partition_the_filtered_listing(n in 0usize..60, size in 1u64..20) {
            let all: Vec<String> = (0..n).map(|i| format!("q{i:03}")).collect();
            let body = Value::Array(all.iter().map(|s| json!({"name": s})).collect());
            let first = q(&format!("page=1&page_size={size}")).unwrap().apply(body.clone()).unwrap();
            let pages = first["page_count"].as_u64().unwrap();
            let mut seen = Vec::new();
            for p in 1..=pages {
                let r = q(&format!("page={p}&page_size={size}")).unwrap().apply(body.clone()).unwrap();
                for i in r["items"].as_array().unwrap() {
                    seen.push(i["name"].as_str().unwrap().to_string());
                }
            }
            prop_assert_eq!(seen, all);
        }
    }
}
