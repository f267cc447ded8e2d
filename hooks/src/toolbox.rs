//! MCP Toolbox's own tools, from its configuration (`tools.yaml`): a tool of type `postgres-sql`
//! is parameterised SQL. Its statement is known ahead, so a call is classified like a call of
//! the SQL tool, with its parameters bound as literals; a write is rewritten to record its undo
//! rows and run through a hidden `postgres-execute-sql` tool of the same source, which the proxy
//! adds to the configuration it starts Toolbox with (the same server, connection and answer
//! format), and hides from the harness.
//!
//! Both of Toolbox's formats are read: the map of `sources:` and `tools:` (each with `kind`), and
//! the flat one (YAML documents with `kind: source|tool`, `name` and `type`).

use crate::error::{Error, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The hidden tool's name for a source.
pub fn hidden_tool(source: &str) -> String {
    format!("planarian-execute-sql-{source}")
}

#[derive(Debug, Clone, PartialEq)]
pub struct Param {
    pub name: String,
    pub default: Option<Value>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Tool {
    /// `postgres-sql`: a statement with `$1`, `$2`, … in the order of its parameters.
    Sql { source: String, statement: String, params: Vec<Param>, templated: bool },
    /// `postgres-execute-sql`: free-form SQL in `sql`.
    ExecuteSql { source: String },
    /// Any other type (its annotations or a spec decide).
    Other(String),
}

#[derive(Debug, Default)]
pub struct Config {
    pub tools: BTreeMap<String, Tool>,
    /// Source name → type (`postgres`, `cloud-sql-postgres`, …).
    pub sources: BTreeMap<String, String>,
    /// Source name → its `database` and `port` as written (`${VAR}` not yet resolved).
    pub targets: BTreeMap<String, (Option<String>, Option<String>)>,
    /// The files it was read from.
    pub files: Vec<PathBuf>,
}

/// The configuration files a Toolbox command line names (`--config F`, `--configs A,B`,
/// `--config-folder D`, and the older `--tools-file F`), each as its arguments' index and files.
pub fn config_args(args: &[String]) -> Vec<(usize, usize, Vec<PathBuf>)> {
    let mut out = vec![];
    let mut i = 0;
    while i < args.len() {
        let (flag, inline) = match args[i].split_once('=') {
            Some((f, v)) => (f, Some(v.to_string())),
            None => (args[i].as_str(), None),
        };
        let known = [
            "--config",
            "--configs",
            "--config-folder",
            "--tools-file",
            "--tools_file",
            "--tools-files",
            "--tools-folder",
        ];
        if known.contains(&flag) {
            let (value, end) = match inline {
                Some(v) => (Some(v), i + 1),
                None => (args.get(i + 1).cloned(), i + 2),
            };
            if let Some(v) = value {
                let files = if flag.ends_with("folder") {
                    let mut f: Vec<PathBuf> = std::fs::read_dir(&v)
                        .map(|d| {
                            d.flatten()
                                .map(|e| e.path())
                                .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
                                .collect()
                        })
                        .unwrap_or_default();
                    f.sort();
                    f
                } else {
                    v.split(',').map(PathBuf::from).collect()
                };
                out.push((i, end, files));
            }
            i = end;
        } else {
            i += 1;
        }
    }
    out
}

impl Config {
    pub fn load(files: &[PathBuf]) -> Result<Config> {
        let mut c = Config { files: files.to_vec(), ..Default::default() };
        for f in files {
            let text = std::fs::read_to_string(f)
                .map_err(|e| Error::Invalid(format!("cannot read Toolbox's configuration {}: {e}", f.display())))?;
            c.add(&text).map_err(|e| e.context(format!("Toolbox's configuration {}", f.display())))?;
        }
        Ok(c)
    }

    fn add(&mut self, text: &str) -> Result<()> {
        use serde::Deserialize;
        for doc in serde_yaml::Deserializer::from_str(text) {
            let v = Value::deserialize(doc).map_err(|e| Error::Invalid(e.to_string()))?;
            if v.is_null() {
                continue;
            }
            match v["kind"].as_str() {
                // The flat format: one object a document.
                Some(kind) => {
                    let name = v["name"]
                        .as_str()
                        .ok_or_else(|| Error::Invalid("a document without a name".into()))?
                        .to_string();
                    let ty = v["type"].as_str().unwrap_or_default();
                    match kind {
                        "source" | "sources" => {
                            self.targets.insert(name.clone(), target_of(&v));
                            self.sources.insert(name, ty.to_string());
                        }
                        "tool" | "tools" => {
                            self.tools.insert(name, tool(ty, &v)?);
                        }
                        _ => {}
                    }
                }
                // The map format.
                None => {
                    for (name, s) in v["sources"].as_object().into_iter().flatten() {
                        self.targets.insert(name.clone(), target_of(s));
                        self.sources.insert(
                            name.clone(),
                            s["kind"].as_str().or(s["type"].as_str()).unwrap_or_default().to_string(),
                        );
                    }
                    for (name, t) in v["tools"].as_object().into_iter().flatten() {
                        let ty = t["kind"].as_str().or(t["type"].as_str()).unwrap_or_default();
                        self.tools.insert(name.clone(), tool(ty, t).map_err(|e| e.context(format!("tool {name}")))?);
                    }
                }
            }
        }
        Ok(())
    }

    /// Why the statements of `source` would not land in database `dbname` on `port` (where the
    /// proxy records their undo), if they would not: its `database` or `port` says otherwise.
    /// `${VAR}` and `${VAR:default}` are read from the environment the upstream gets, and
    /// `{dbname}` is the proxy's own database (a fork's branch).
    pub fn elsewhere(&self, source: &str, dbname: &str, port: Option<u16>) -> Option<String> {
        let (db, p) = self.targets.get(source)?;
        let resolve = |v: &str| expand(v).replace("{dbname}", dbname);
        if let Some(db) = db.as_deref().map(resolve).filter(|d| !d.is_empty() && d != dbname) {
            return Some(format!(
                "its source {source} names the database {db}, and this proxy records undo in {dbname} (--database)"
            ));
        }
        match (p.as_deref().map(resolve).and_then(|p| p.parse::<u16>().ok()), port) {
            (Some(a), Some(b)) if a != b => {
                Some(format!("its source {source} is on port {a}, and this proxy's database on port {b} (--database)"))
            }
            _ => None,
        }
    }

    /// Whether a source speaks PostgreSQL.
    pub fn is_postgres(&self, source: &str) -> bool {
        self.sources.get(source).is_some_and(|t| t.contains("postgres") || t == "alloydb-omni")
    }

    /// The sources a hidden execute tool is needed for.
    pub fn sql_sources(&self) -> Vec<String> {
        let s: std::collections::BTreeSet<String> = self
            .tools
            .values()
            .filter_map(|t| match t {
                Tool::Sql { source, .. } if self.is_postgres(source) => Some(source.clone()),
                _ => None,
            })
            .collect();
        s.into_iter().collect()
    }

    /// The configuration added to Toolbox's: a hidden execute tool per source, in the flat format.
    pub fn hidden_tools_yaml(&self) -> String {
        self.sql_sources()
            .iter()
            .map(|s| {
                format!(
                    "kind: tool\nname: {}\ntype: postgres-execute-sql\nsource: {s}\ndescription: planarian's way to run the rewritten statements of this source's tools (hidden from the harness)\n",
                    hidden_tool(s)
                )
            })
            .collect::<Vec<_>>()
            .join("---\n")
    }
}

fn target_of(v: &Value) -> (Option<String>, Option<String>) {
    let s = |k: &str| match &v[k] {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    };
    (s("database"), s("port"))
}

/// `${VAR}` and `${VAR:default}` from the environment, as Toolbox reads its configuration.
fn expand(v: &str) -> String {
    let mut out = String::new();
    let mut rest = v;
    while let Some(i) = rest.find("${") {
        out.push_str(&rest[..i]);
        let Some(j) = rest[i..].find('}') else { break };
        let inner = &rest[i + 2..i + j];
        let (name, default) = inner.split_once(':').map_or((inner, ""), |(n, d)| (n, d));
        out.push_str(&std::env::var(name).unwrap_or_else(|_| default.to_string()));
        rest = &rest[i + j + 1..];
    }
    out.push_str(rest);
    out
}

fn tool(ty: &str, v: &Value) -> Result<Tool> {
    let source = v["source"].as_str().unwrap_or_default().to_string();
    Ok(match ty {
        "postgres-sql" => {
            let statement = v["statement"]
                .as_str()
                .ok_or_else(|| Error::Invalid("a postgres-sql tool without a statement".into()))?
                .to_string();
            let params = v["parameters"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|p| Param {
                    name: p["name"].as_str().unwrap_or_default().to_string(),
                    default: p.get("default").cloned(),
                })
                .collect();
            let templated = v["templateParameters"].as_array().is_some_and(|a| !a.is_empty());
            Tool::Sql { source, statement, params, templated }
        }
        "postgres-execute-sql" => Tool::ExecuteSql { source },
        other => Tool::Other(other.to_string()),
    })
}

/// A value as an untyped SQL literal: the server infers its type from where it stands, as it
/// does for a parameter.
fn literal(v: &Value) -> String {
    fn array_element(v: &Value) -> String {
        match v {
            Value::Null => "NULL".into(),
            Value::Array(a) => format!("{{{}}}", a.iter().map(array_element).collect::<Vec<_>>().join(",")),
            Value::String(s) => format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\"")),
            other => format!("\"{}\"", other.to_string().replace('\\', "\\\\").replace('"', "\\\"")),
        }
    }
    match v {
        Value::Null => "NULL".into(),
        Value::String(s) => crate::sql::quote_literal(s),
        Value::Array(_) => crate::sql::quote_literal(&array_element(v)),
        Value::Object(_) => crate::sql::quote_literal(&v.to_string()),
        other => crate::sql::quote_literal(&other.to_string()),
    }
}

/// The statement with its parameters bound from the call's arguments (a parameter missing from
/// them takes its default). Only the statement's own `$N` tokens are replaced: not those inside
/// strings, identifiers or comments.
pub fn bind(statement: &str, params: &[Param], args: &Value) -> Result<String> {
    let tokens =
        pg_query::scan(statement).map_err(|e| Error::Sql(format!("cannot read the tool's statement: {e}")))?.tokens;
    let mut out = String::new();
    let mut at = 0usize;
    for t in tokens.iter().filter(|t| t.token == pg_query::protobuf::Token::Param as i32) {
        let (s, e) = (t.start as usize, t.end as usize);
        let n: usize = statement[s + 1..e]
            .parse()
            .map_err(|_| Error::Invalid(format!("{}: not a parameter", &statement[s..e])))?;
        let p = params.get(n.wrapping_sub(1)).ok_or_else(|| {
            Error::Invalid(format!("the statement's ${n} has no parameter (it declares {})", params.len()))
        })?;
        let v = match args.get(&p.name) {
            Some(v) => v,
            None => p.default.as_ref().ok_or_else(|| Error::Invalid(format!("the argument {} is missing", p.name)))?,
        };
        out.push_str(&statement[at..s]);
        out.push_str(&literal(v));
        at = e;
    }
    out.push_str(&statement[at..]);
    Ok(out)
}

/// Toolbox's command line with the hidden tools' file added to its configuration (written to
/// `extra`); unchanged when no tool needs one.
pub fn with_hidden_tools(args: &[String], config: &Config, extra: &Path) -> Result<Vec<String>> {
    let yaml = config.hidden_tools_yaml();
    if yaml.is_empty() {
        return Ok(args.to_vec());
    }
    let found = config_args(args);
    let Some((start, end, _)) = found.first() else { return Ok(args.to_vec()) };
    sys::write_atomic(extra, yaml.as_bytes(), 0o600).map_err(Error::from)?;
    let mut files: Vec<String> = config.files.iter().map(|f| f.display().to_string()).collect();
    files.push(extra.display().to_string());
    let mut out = args[..*start].to_vec();
    out.push("--configs".into());
    out.push(files.join(","));
    out.extend_from_slice(&args[*end..]);
    Ok(out)
}

/// Whether a `tools/list` answer's tool is one the harness must not see.
pub fn is_hidden(name: &str) -> bool {
    name.starts_with("planarian-execute-sql-")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn params(names: &[&str]) -> Vec<Param> {
        names.iter().map(|n| Param { name: n.to_string(), default: None }).collect()
    }

    #[test]
    fn parameters_are_bound_as_literals_outside_strings_and_comments() {
        let st = "INSERT INTO t (a, b, c) VALUES ($1, $2, '$1 stays') -- $2 stays\n RETURNING $3::int[], \"$1\"";
        let got = bind(st, &params(&["a", "b", "c"]), &json!({"a": "it's", "b": 42, "c": [1, 2, "x\"y"]})).unwrap();
        assert_eq!(got, "INSERT INTO t (a, b, c) VALUES ('it''s', '42', '$1 stays') -- $2 stays\n RETURNING '{\"1\",\"2\",\"x\\\"y\"}'::int[], \"$1\"");
        let with_default = vec![Param { name: "n".into(), default: Some(json!(7)) }];
        assert_eq!(bind("SELECT $1", &with_default, &json!({})).unwrap(), "SELECT '7'");
        assert!(bind("SELECT $1", &params(&["a"]), &json!({})).unwrap_err().to_string().contains("missing"));
        assert!(bind("SELECT $2", &params(&["a"]), &json!({"a": 1})).unwrap_err().to_string().contains("no parameter"));
        assert_eq!(bind("SELECT $1", &params(&["a"]), &json!({"a": null})).unwrap(), "SELECT NULL");
    }

    #[test]
    fn both_configuration_formats_are_read() {
        let map = "sources:\n  pg:\n    kind: postgres\n    host: h\ntools:\n  add:\n    kind: postgres-sql\n    source: pg\n    description: d\n    parameters:\n      - name: body\n        type: string\n        description: x\n    statement: INSERT INTO n (b) VALUES ($1)\n  run:\n    kind: postgres-execute-sql\n    source: pg\n    description: d\n";
        let flat = "kind: source\nname: pg2\ntype: cloud-sql-postgres\n---\nkind: tool\nname: list\ntype: postgres-sql\nsource: pg2\ndescription: d\nstatement: SELECT 1\n---\nkind: tool\nname: other\ntype: postgres-list-tables\nsource: pg2\ndescription: d\n";
        let mut c = Config::default();
        c.add(map).unwrap();
        c.add(flat).unwrap();
        assert_eq!(
            c.tools["add"],
            Tool::Sql {
                source: "pg".into(),
                statement: "INSERT INTO n (b) VALUES ($1)".into(),
                params: params(&["body"]),
                templated: false
            }
        );
        assert_eq!(c.tools["run"], Tool::ExecuteSql { source: "pg".into() });
        assert_eq!(c.tools["other"], Tool::Other("postgres-list-tables".into()));
        assert!(c.is_postgres("pg2"));
        // (the map's source names no database: nothing to compare; the flat one's none either)
        assert_eq!(c.elsewhere("pg", "postgres", Some(5432)), None);
        c.targets.insert("pg3".into(), (Some("${PLANARIAN_TEST_UNSET_DB:orders}".into()), Some("5433".into())));
        assert!(c.elsewhere("pg3", "postgres", None).unwrap().contains("names the database orders"));
        assert!(c.elsewhere("pg3", "orders", Some(5432)).unwrap().contains("port 5433"));
        assert_eq!(c.elsewhere("pg3", "orders", Some(5433)), None);
        c.targets.insert("pg4".into(), (Some("{dbname}".into()), None));
        assert_eq!(c.elsewhere("pg4", "postgres_fork1", None), None, "a fork's branch");
        assert_eq!(c.sql_sources(), vec!["pg".to_string(), "pg2".to_string()]);
        assert!(c
            .hidden_tools_yaml()
            .contains("name: planarian-execute-sql-pg2\ntype: postgres-execute-sql\nsource: pg2"));
    }

    #[test]
    fn the_command_line_gets_the_hidden_tools_file() {
        let args: Vec<String> = ["--config", "/a.yaml", "--stdio"].iter().map(|s| s.to_string()).collect();
        assert_eq!(config_args(&args), vec![(0, 2, vec![PathBuf::from("/a.yaml")])]);
        let args2: Vec<String> = ["--stdio", "--configs=/a.yaml,/b.yaml"].iter().map(|s| s.to_string()).collect();
        assert_eq!(config_args(&args2), vec![(1, 2, vec![PathBuf::from("/a.yaml"), PathBuf::from("/b.yaml")])]);
        let mut c = Config { files: vec![PathBuf::from("/a.yaml")], ..Default::default() };
        c.sources.insert("pg".into(), "postgres".into());
        c.tools.insert(
            "t".into(),
            Tool::Sql { source: "pg".into(), statement: "SELECT 1".into(), params: vec![], templated: false },
        );
        let scratch = tempfile::tempdir().unwrap();
        let extra = scratch.path().join("hidden.yaml");
        let out = with_hidden_tools(&args, &c, &extra).unwrap();
        assert_eq!(out, vec!["--configs".to_string(), format!("/a.yaml,{}", extra.display()), "--stdio".to_string()]);
        std::fs::remove_file(extra).unwrap();
    }
}
