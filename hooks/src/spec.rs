//! Declared compensations: for the tools of a proxied server that the proxy does not understand
//! itself, how a call's effect is undone through the server's own tools.
//!
//! A spec is a TOML file (the project ships some in `hooks/specs/`, selected by name):
//!
//! ```toml
//! server = "filesystem"                  # what the spec is for (said in refusals)
//! reads = ["list_allowed_directories"]   # tools that only read, whatever the server says
//! pass = []                              # tools let through unrecorded (statepoints then
//!                                        # no longer cover the service, and say so)
//! [refuse]
//! some_tool = "why it cannot be undone"
//!
//! [tools.write_file]
//! capture = { call = "read_text_file", arguments = { path = "$args.path" } }   # → $pre
//! refuse_when_capture_fails = "it would create a file, and no tool deletes one"
//! undo = [{ call = "write_file", arguments = { path = "$args.path", content = "$pre.content" } }]
//! check = { call = "read_text_file", arguments = { path = "$args.path" } }
//! ```
//!
//! Templates are JSON values: a string starting with `$` is an expression, `{"$each": EXPR, …}`
//! is the rest of the object made once per element of EXPR (as `$item`), anything else is itself.
//! An expression is a root (`$args`: the call's arguments, `$result`: its answer, `$pre`: the
//! capture's answer, `$item`) followed by `.field`, `[N]` or `[*]` (each element); `A minus B`
//! is the elements of array A that are not in array B. A tool's answer is its
//! `structuredContent`, or else its first text item read as JSON, or else that text.
//!
//! `check` is read right after the call and again right before its undo: when the answers
//! differ, something other than this proxy changed what the call left, and the rollback stops
//! with a conflict instead of clobbering it (`unordered = true` compares arrays as sets).

use crate::error::{Error, Result};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// The specs shipped with planarian, by name.
pub const BUILTIN: &[(&str, &str)] = &[
    ("memory", include_str!("../specs/memory.toml")),
    ("filesystem", include_str!("../specs/filesystem.toml")),
    ("toolbox-postgres", include_str!("../specs/toolbox-postgres.toml")),
];

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Spec {
    #[serde(default)]
    pub server: String,
    #[serde(default)]
    pub reads: Vec<String>,
    #[serde(default)]
    pub pass: Vec<String>,
    #[serde(default)]
    pub refuse: BTreeMap<String, String>,
    #[serde(default)]
    pub tools: BTreeMap<String, ToolSpec>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolSpec {
    /// A call is a read (passes, no position) when this expression holds, e.g. `$args.dryRun`.
    #[serde(default)]
    pub read_if: Option<String>,
    /// The read that captures what the call will change (its answer is `$pre`).
    #[serde(default)]
    pub capture: Option<Call>,
    /// When the capture fails (what the call would create is not there yet): refused, saying this.
    #[serde(default)]
    pub refuse_when_capture_fails: Option<String>,
    /// `[TEXT, WHY]`: refused when the capture's answer contains TEXT (e.g. U+FFFD: what was
    /// read is not text, and could not be written back as it was).
    #[serde(default)]
    pub refuse_when_pre_contains: Option<(String, String)>,
    /// The calls that undo it, in order.
    pub undo: Vec<Call>,
    #[serde(default)]
    pub check: Option<Call>,
}

#[derive(Debug, Clone, Deserialize, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Call {
    pub call: String,
    #[serde(default = "empty_object")]
    pub arguments: Value,
    /// Compare answers with every array taken as a set.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unordered: bool,
}

fn empty_object() -> Value {
    json!({})
}

impl Spec {
    /// A builtin spec by name, or a file.
    pub fn load(name_or_path: &str) -> Result<Spec> {
        let (what, text) = match BUILTIN.iter().find(|(n, _)| *n == name_or_path) {
            Some((_, t)) => (format!("the builtin spec {name_or_path}"), t.to_string()),
            None => (
                name_or_path.to_string(),
                std::fs::read_to_string(name_or_path).map_err(|e| {
                    let names: Vec<&str> = BUILTIN.iter().map(|(n, _)| *n).collect();
                    Error::Invalid(format!("--spec {name_or_path}: {e} (builtin specs: {})", names.join(", ")))
                })?,
            ),
        };
        let spec: Spec = toml::from_str(&text).map_err(|e| Error::Invalid(format!("{what}: {e}")))?;
        spec.validate().map_err(|e| e.context(&what))?;
        Ok(spec)
    }

    /// Every expression parses.
    fn validate(&self) -> Result<()> {
        for (name, t) in &self.tools {
            let calls = t.capture.iter().chain(&t.undo).chain(&t.check);
            for c in calls {
                check_template(&c.arguments).map_err(|e| e.context(format!("tool {name}")))?;
            }
            if let Some(r) = &t.read_if {
                Expr::parse(r).map_err(|e| e.context(format!("tool {name}: read_if")))?;
            }
            if t.refuse_when_capture_fails.is_some() && t.capture.is_none() {
                return Err(Error::Invalid(format!("tool {name}: refuse_when_capture_fails needs a capture")));
            }
        }
        Ok(())
    }
}

fn check_template(t: &Value) -> Result<()> {
    match t {
        Value::String(s) if s.starts_with('$') => Expr::parse(s).map(drop),
        Value::Array(a) => a.iter().try_for_each(check_template),
        Value::Object(o) => o.values().try_for_each(check_template),
        _ => Ok(()),
    }
}

/// What a template is made from.
#[derive(Debug, Default, Clone, serde::Serialize, Deserialize, PartialEq)]
pub struct Scope {
    pub args: Value,
    #[serde(default)]
    pub result: Value,
    #[serde(default)]
    pub pre: Value,
    #[serde(skip)]
    pub item: Value,
}

/// A tool's answer as a value: `structuredContent`, else its first text read as JSON, else that text.
pub fn answer(result: &Value) -> Value {
    if let Some(s) = result.get("structuredContent").filter(|s| !s.is_null()) {
        return s.clone();
    }
    match result["content"][0]["text"].as_str() {
        Some(t) => serde_json::from_str(t).unwrap_or_else(|_| json!(t)),
        None => Value::Null,
    }
}

/// Whether a tool's answer (a `tools/call` result, or a JSON-RPC response) is a failure.
pub fn failed(resp: &Value) -> bool {
    resp.get("error").is_some() || resp["result"]["isError"] == json!(true) || resp["isError"] == json!(true)
}

/// Answers compared as the check says: arrays as sets when `unordered`.
pub fn same_answer(a: &Value, b: &Value, unordered: bool) -> bool {
    fn canon(v: &Value) -> Value {
        match v {
            Value::Array(a) => {
                let mut items: Vec<Value> = a.iter().map(canon).collect();
                items.sort_by_key(|x| x.to_string());
                Value::Array(items)
            }
            Value::Object(o) => Value::Object(o.iter().map(|(k, v)| (k.clone(), canon(v))).collect()),
            v => v.clone(),
        }
    }
    if unordered {
        canon(a) == canon(b)
    } else {
        a == b
    }
}

/// Renders a template.
pub fn render(t: &Value, scope: &Scope) -> Result<Value> {
    match t {
        Value::String(s) if s.starts_with("$$") => Ok(json!(&s[1..])),
        Value::String(s) if s.starts_with('$') => Expr::parse(s)?.eval(scope),
        Value::Array(a) => a.iter().map(|x| render(x, scope)).collect::<Result<Vec<_>, _>>().map(Value::Array),
        Value::Object(o) => match o.get("$each") {
            Some(Value::String(e)) => {
                let rest: serde_json::Map<String, Value> =
                    o.iter().filter(|(k, _)| *k != "$each").map(|(k, v)| (k.clone(), v.clone())).collect();
                let items = match Expr::parse(e)?.eval(scope)? {
                    Value::Array(a) => a,
                    Value::Null => vec![],
                    other => return Err(Error::Invalid(format!("$each {e}: not an array but {other}"))),
                };
                items
                    .into_iter()
                    .map(|item| render(&Value::Object(rest.clone()), &Scope { item, ..scope.clone() }))
                    .collect::<Result<Vec<_>, _>>()
                    .map(Value::Array)
            }
            Some(other) => Err(Error::Invalid(format!("$each must be an expression, not {other}"))),
            None => o
                .iter()
                .map(|(k, v)| Ok((k.clone(), render(v, scope)?)))
                .collect::<Result<serde_json::Map<_, _>>>()
                .map(Value::Object),
        },
        v => Ok(v.clone()),
    }
}

/// Whether an expression holds (true, a non-empty string, array or object, a non-zero number).
pub fn holds(expr: &str, scope: &Scope) -> Result<bool> {
    Ok(match Expr::parse(expr)?.eval(scope)? {
        Value::Null => false,
        Value::Bool(b) => b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    })
}

#[derive(Debug, PartialEq)]
enum Step {
    Field(String),
    Index(usize),
    Each,
}

#[derive(Debug, PartialEq)]
enum Expr {
    Path(String, Vec<Step>),
    Minus(Box<Expr>, Box<Expr>),
}

impl Expr {
    fn parse(s: &str) -> Result<Expr> {
        if let Some((a, b)) = s.split_once(" minus ") {
            return Ok(Expr::Minus(Box::new(Expr::parse(a.trim())?), Box::new(Expr::parse(b.trim())?)));
        }
        let body = s.strip_prefix('$').ok_or_else(|| Error::Invalid(format!("{s}: an expression starts with $")))?;
        let root_end = body.find(['.', '[']).unwrap_or(body.len());
        let root = &body[..root_end];
        if !["args", "result", "pre", "item"].contains(&root) {
            return Err(Error::Invalid(format!("{s}: unknown root ${root} (known: $args, $result, $pre, $item)")));
        }
        let mut steps = vec![];
        let mut rest = &body[root_end..];
        while !rest.is_empty() {
            if let Some(r) = rest.strip_prefix('.') {
                let end = r.find(['.', '[']).unwrap_or(r.len());
                if end == 0 {
                    return Err(Error::Invalid(format!("{s}: empty field name")));
                }
                steps.push(Step::Field(r[..end].to_string()));
                rest = &r[end..];
            } else if let Some(r) = rest.strip_prefix('[') {
                let end = r.find(']').ok_or_else(|| Error::Invalid(format!("{s}: unclosed [")))?;
                let inner = &r[..end];
                steps.push(if inner == "*" {
                    Step::Each
                } else {
                    Step::Index(
                        inner
                            .parse()
                            .map_err(|_| Error::Invalid(format!("{s}: [{inner}] is neither * nor an index")))?,
                    )
                });
                rest = &r[end + 1..];
            } else {
                return Err(Error::Invalid(format!("{s}: unexpected {rest}")));
            }
        }
        Ok(Expr::Path(root.to_string(), steps))
    }

    fn eval(&self, scope: &Scope) -> Result<Value> {
        match self {
            Expr::Minus(a, b) => {
                let (a, b) = (a.eval(scope)?, b.eval(scope)?);
                let (Value::Array(a), b) = (a, b) else { return Err(Error::Invalid("minus takes arrays".into())) };
                let b = match b {
                    Value::Array(b) => b,
                    Value::Null => vec![],
                    _ => return Err(Error::Invalid("minus takes arrays".into())),
                };
                Ok(Value::Array(a.into_iter().filter(|x| !b.contains(x)).collect()))
            }
            Expr::Path(root, steps) => {
                let start = match root.as_str() {
                    "args" => &scope.args,
                    "result" => &scope.result,
                    "pre" => &scope.pre,
                    _ => &scope.item,
                };
                let mut many = false;
                let mut cur = vec![start.clone()];
                for step in steps {
                    cur = match step {
                        Step::Field(f) => cur.into_iter().map(|v| v.get(f).cloned().unwrap_or(Value::Null)).collect(),
                        Step::Index(i) => cur.into_iter().map(|v| v.get(i).cloned().unwrap_or(Value::Null)).collect(),
                        Step::Each => {
                            many = true;
                            cur.into_iter().flat_map(|v| if let Value::Array(a) = v { a } else { vec![] }).collect()
                        }
                    };
                }
                Ok(if many { Value::Array(cur) } else { cur.pop().unwrap_or(Value::Null) })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_take_paths_projections_each_and_minus() {
        let scope = Scope {
            args: json!({"entities": [{"name": "a"}, {"name": "b"}], "path": "/x", "dryRun": true}),
            result: json!({"results": [{"entityName": "a", "addedObservations": ["o1"]}]}),
            pre: json!({"entities": [{"name": "b"}]}),
            item: Value::Null,
        };
        let t = json!({
            "names": "$args.entities[*].name minus $pre.entities[*].name",
            "first": "$args.entities[0].name",
            "path": "$args.path",
            "literal": "$$args",
            "missing": "$args.nothing.deeper",
            "deletions": {"$each": "$result.results", "entityName": "$item.entityName", "observations": "$item.addedObservations"},
        });
        assert_eq!(
            render(&t, &scope).unwrap(),
            json!({"names": ["a"], "first": "a", "path": "/x", "literal": "$args", "missing": null,
                   "deletions": [{"entityName": "a", "observations": ["o1"]}]})
        );
        assert!(holds("$args.dryRun", &scope).unwrap());
        assert!(!holds("$args.nothing", &scope).unwrap());
        assert!(Expr::parse("$argz.x").unwrap_err().to_string().contains("unknown root"));
        assert!(Expr::parse("$args.x[").unwrap_err().to_string().contains("unclosed"));
        assert!(Expr::parse("$args.x[y]").unwrap_err().to_string().contains("neither"));
    }

    #[test]
    fn answers_and_their_comparison() {
        assert_eq!(answer(&json!({"content": [{"type": "text", "text": "{\"a\":1}"}]})), json!({"a": 1}));
        assert_eq!(answer(&json!({"content": [{"type": "text", "text": "plain"}]})), json!("plain"));
        assert_eq!(answer(&json!({"content": [], "structuredContent": {"b": 2}})), json!({"b": 2}));
        let (a, b) = (json!({"x": [1, 2, {"y": [3, 4]}]}), json!({"x": [{"y": [4, 3]}, 2, 1]}));
        assert!(same_answer(&a, &b, true));
        assert!(!same_answer(&a, &b, false));
    }

    #[test]
    fn the_builtin_specs_load() {
        for (name, _) in BUILTIN {
            let s = Spec::load(name).unwrap();
            assert!(!s.tools.is_empty() || !s.reads.is_empty(), "{name}");
        }
        assert!(Spec::load("/nonexistent.toml")
            .unwrap_err()
            .to_string()
            .contains("builtin specs: memory, filesystem, toolbox-postgres"));
    }
}
