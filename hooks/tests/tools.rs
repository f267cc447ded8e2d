//! The tool policy against real MCP servers: the reference knowledge-graph and filesystem
//! servers with the specs planarian ships, MCP Toolbox with a configuration of its own SQL
//! tools, tools nobody classified (refused), the explicit pass (and its mark), and a disabled
//! proxy (a fork's: it reaches nothing).
//!
//! Each run of calls is made as an agent would, through the proxy; then the proxy compensates
//! back to every earlier position, newest first, and each time the service's whole state —
//! read behind the server's back (its file, its directory, its tables) — must be what it was.
//!
//! Needs target/npm (tests/run installs the servers) and PostgreSQL's server binaries for the
//! Toolbox test; without them the tests say SKIPPED loudly (tests/run installs them, so in CI
//! nothing is skipped).

mod common;

use common::{control, pg_bin, root, Mcp, Pg};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn bin(name: &str) -> Option<PathBuf> {
    let p = root().join("target/npm/node_modules/.bin").join(name);
    p.exists().then_some(p)
}

macro_rules! require_bin {
    ($name:expr) => {
        match bin($name) {
            Some(p) => p,
            None => {
                eprintln!("SKIPPED {}: needs {} (tests/run installs it under target/npm)", module_path!(), $name);
                return;
            }
        }
    };
}

/// A scratch directory (removed when the first is dropped) and a directory `tag` made in it.
fn scratch(tag: &str) -> (tempfile::TempDir, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let d = t.path().join(tag);
    std::fs::create_dir_all(&d).unwrap();
    (t, d)
}

struct Proxied {
    mcp: Mcp,
    control: PathBuf,
}

impl Proxied {
    /// The proxy in front of `upstream`, with these extra arguments.
    fn start(dir: &Path, extra: &[&str], upstream: Command) -> Proxied {
        let control = dir.join("control.sock");
        let mut c = Command::new(env!("CARGO_BIN_EXE_planarian-mcp-proxy"));
        c.args(["serve", "--control"]).arg(&control).arg("--state").arg(dir.join("positions.json")).args(extra);
        c.arg("--").arg(upstream.get_program()).args(upstream.get_args());
        for (k, v) in upstream.get_envs() {
            c.env(k, v.unwrap());
        }
        c.stderr(Stdio::null());
        Proxied { mcp: Mcp::spawn(c), control }
    }

    fn call(&mut self, tool: &str, args: Value) -> Value {
        let r = self.mcp.request("tools/call", json!({"name": tool, "arguments": args}));
        assert!(r.get("result").is_some(), "{tool}: {r}");
        r["result"].clone()
    }

    fn position(&self) -> u64 {
        control(&self.control, &["position"]).unwrap()["position"].as_u64().unwrap()
    }
}

fn is_error(r: &Value) -> bool {
    r["isError"] == json!(true)
}

fn text(r: &Value) -> String {
    r["content"][0]["text"].as_str().unwrap_or_default().to_string()
}

/// Makes each call (none may fail) and notes, after each, the position and the whole state.
fn run(p: &mut Proxied, calls: &[(&str, Value)], state: &dyn Fn() -> String, at: &mut Vec<(u64, String)>) {
    for (tool, args) in calls {
        let r = p.call(tool, args.clone());
        assert!(!is_error(&r), "{tool} {args}: {r}");
        at.push((p.position(), state()));
    }
}

/// Compensates back to every earlier position noted, newest first: each time the state must be
/// exactly what it was when that position was current.
fn back_through(p: &Proxied, at: &[(u64, String)], state: &dyn Fn() -> String) {
    for (pos, want) in at.iter().rev().skip(1) {
        let r = control(&p.control, &["compensate", &pos.to_string()])
            .unwrap_or_else(|e| panic!("compensate to {pos}: {e}"));
        assert_eq!(r["position"].as_u64(), Some(*pos));
        assert_eq!(&state(), want, "after compensating to position {pos}");
    }
}

// --- the knowledge graph --------------------------------------------------------------------

fn memory_server(file: &Path) -> Command {
    let mut c = Command::new(bin("mcp-server-memory").unwrap());
    c.env("MEMORY_FILE_PATH", file);
    c
}

/// The graph in its file, as the server keeps it, taken as sets (entities with their
/// observations in order, relations), in a stable order.
fn graph(file: &Path) -> String {
    let text = std::fs::read_to_string(file).unwrap_or_default();
    let mut entities = BTreeMap::new();
    let mut relations = vec![];
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).unwrap();
        match v["type"].as_str() {
            Some("entity") => {
                assert!(
                    entities
                        .insert(
                            v["name"].as_str().unwrap().to_string(),
                            (v["entityType"].clone(), v["observations"].clone())
                        )
                        .is_none(),
                    "an entity twice: {v}"
                );
            }
            Some("relation") => relations.push(format!("{} -{}-> {}", v["from"], v["relationType"], v["to"])),
            _ => panic!("{line}"),
        }
    }
    relations.sort();
    let n = relations.len();
    relations.dedup();
    assert_eq!(n, relations.len(), "a relation twice");
    format!("{entities:?}\n{relations:?}")
}

#[test]
fn the_knowledge_graph_is_put_back_at_every_position() {
    require_bin!("mcp-server-memory");
    let (_scratch, dir) = scratch("memory");
    let file = dir.join("memory.jsonl");
    let mut p = Proxied::start(&dir, &["--spec", "memory"], memory_server(&file));
    let state = || graph(&file);
    let mut at = vec![(p.position(), state())];
    let e = |n: &str, t: &str, o: &[&str]| json!({"name": n, "entityType": t, "observations": o});
    let r = |f: &str, t: &str, k: &str| json!({"from": f, "to": t, "relationType": k});
    let calls = vec![
        (
            "create_entities",
            json!({"entities": [e("ann", "person", &["likes tea", "works at acme"]), e("acme", "company", &[]), e("bob", "person", &["new"])]}),
        ),
        (
            "create_relations",
            json!({"relations": [r("ann", "acme", "works_at"), r("bob", "acme", "works_at"), r("ann", "bob", "knows")]}),
        ),
        (
            "add_observations",
            json!({"observations": [{"entityName": "ann", "contents": ["likes tea", "plays chess"]}, {"entityName": "acme", "contents": ["founded 1990"]}]}),
        ),
        // (ann exists: only cy is created)
        ("create_entities", json!({"entities": [e("ann", "robot", &["other"]), e("cy", "person", &[])]})),
        ("delete_observations", json!({"deletions": [{"entityName": "ann", "observations": ["likes tea"]}]})),
        ("delete_relations", json!({"relations": [r("ann", "bob", "knows"), r("cy", "ann", "never")]})),
        ("create_relations", json!({"relations": [r("cy", "ann", "knows"), r("bob", "acme", "works_at")]})),
        ("delete_entities", json!({"entityNames": ["ann", "nobody"]})),
        ("add_observations", json!({"observations": [{"entityName": "bob", "contents": ["was at acme"]}]})),
    ];
    run(&mut p, &calls, &state, &mut at);
    // Reads pass and take no position.
    let before = p.position();
    let g = p.call("read_graph", json!({}));
    assert!(!is_error(&g) && text(&g).contains("\"bob\""), "{g}");
    assert!(!is_error(&p.call("search_nodes", json!({"query": "acme"}))));
    assert_eq!(p.position(), before);
    assert_eq!(
        at.iter().map(|(p, _)| *p).collect::<Vec<_>>(),
        (at[0].0..=at[0].0 + 9).collect::<Vec<_>>(),
        "each change takes a position"
    );
    back_through(&p, &at, &state);
    assert_eq!(state(), at[0].1);

    // Forward again, then a change behind the proxy's back: undoing over it is a conflict, and
    // nothing is clobbered.
    let base = p.position();
    run(&mut p, &[("create_entities", json!({"entities": [e("dee", "person", &["x"])]}))], &state, &mut vec![]);
    run(
        &mut p,
        &[("add_observations", json!({"observations": [{"entityName": "dee", "contents": ["y"]}]}))],
        &state,
        &mut vec![],
    );
    let edited = std::fs::read_to_string(&file).unwrap().replace("[\"x\",\"y\"]", "[\"x\",\"y\",\"by hand\"]");
    std::fs::write(&file, &edited).unwrap();
    let err = control(&p.control, &["compensate", &base.to_string()]).unwrap_err();
    assert!(err.contains("conflict") && err.contains("add_observations"), "{err}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), edited, "a conflict changes nothing");
    // (the journal survives a restarted proxy: the undo still knows the call)
    drop(p);
    std::fs::write(&file, std::fs::read_to_string(&file).unwrap().replace(",\"by hand\"", "")).unwrap();
    let p = Proxied::start(&dir, &["--spec", "memory"], memory_server(&file));
    control(&p.control, &["compensate", &base.to_string()]).unwrap();
    assert_eq!(state(), at[0].1);
}

// --- the filesystem ---------------------------------------------------------------------------

/// Every entry under `dir`: path, type, mode and content.
fn tree(dir: &Path) -> String {
    use std::os::unix::fs::PermissionsExt;
    fn walk(base: &Path, d: &Path, out: &mut Vec<String>) {
        let mut entries: Vec<_> = std::fs::read_dir(d).unwrap().flatten().collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let p = e.path();
            let m = std::fs::symlink_metadata(&p).unwrap();
            let rel = p.strip_prefix(base).unwrap().display().to_string();
            if m.is_dir() {
                out.push(format!("{rel}/ {:o}", m.permissions().mode()));
                walk(base, &p, out);
            } else {
                out.push(format!("{rel} {:o} {:?}", m.permissions().mode(), std::fs::read(&p).unwrap()));
            }
        }
    }
    let mut out = vec![];
    walk(dir, dir, &mut out);
    out.join("\n")
}

#[test]
fn files_outside_the_sandbox_are_put_back_and_what_cannot_be_undone_is_refused() {
    require_bin!("mcp-server-filesystem");
    let (_scratch, dir) = scratch("fs");
    let data = dir.join("data");
    std::fs::create_dir_all(data.join("sub")).unwrap();
    std::fs::write(data.join("a.txt"), "one\ntwo\nthree\n").unwrap();
    std::fs::write(data.join("crlf.txt"), "x\r\ny\r\n").unwrap();
    std::fs::write(data.join("bin.dat"), [0xffu8, 0xfe, 0x00, 0x41]).unwrap();
    std::fs::write(data.join("sub/b.txt"), "bee").unwrap();
    std::fs::set_permissions(data.join("sub/b.txt"), std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let mut server = Command::new(bin("mcp-server-filesystem").unwrap());
    server.arg(&data);
    let mut p = Proxied::start(&dir, &["--spec", "filesystem"], server);
    let state = || tree(&data);
    let mut at = vec![(p.position(), state())];
    let f = |n: &str| data.join(n).display().to_string();
    let calls = vec![
        ("write_file", json!({"path": f("a.txt"), "content": "replaced\n"})),
        ("edit_file", json!({"path": f("crlf.txt"), "edits": [{"oldText": "y", "newText": "why"}]})),
        ("write_file", json!({"path": f("sub/b.txt"), "content": "b2"})),
        ("move_file", json!({"source": f("a.txt"), "destination": f("sub/a-moved.txt")})),
        // (it exists: nothing to undo, but it is a position)
        ("create_directory", json!({"path": f("sub")})),
        ("edit_file", json!({"path": f("sub/a-moved.txt"), "edits": [{"oldText": "replaced", "newText": "edited"}]})),
    ];
    run(&mut p, &calls, &state, &mut at);
    let last = p.position();
    // Reads and a dry run pass, and take no position.
    let dry = p.call(
        "edit_file",
        json!({"path": f("sub/b.txt"), "edits": [{"oldText": "b2", "newText": "zz"}], "dryRun": true}),
    );
    assert!(!is_error(&dry), "{dry}");
    assert!(!is_error(&p.call("read_text_file", json!({"path": f("sub/b.txt")}))));
    assert!(!is_error(&p.call("list_directory", json!({"path": f("sub")}))));
    // What no tool of this server could undo is refused before it reaches the server.
    for (tool, args, why) in [
        ("write_file", json!({"path": f("new.txt"), "content": "n"}), "no tool that deletes one"),
        ("create_directory", json!({"path": f("newdir/deeper")}), "no tool that removes one"),
        ("write_file", json!({"path": f("bin.dat"), "content": "text"}), "not UTF-8 text"),
        ("edit_file", json!({"path": f("missing.txt"), "edits": [{"oldText": "a", "newText": "b"}]}), "cannot be read"),
    ] {
        let r = p.call(tool, args.clone());
        assert!(
            is_error(&r) && text(&r).starts_with("planarian: not executed:") && text(&r).contains(why),
            "{tool} {args}: {r}"
        );
    }
    assert_eq!(state(), at.last().unwrap().1, "refused calls change nothing");
    assert_eq!(p.position(), last);
    back_through(&p, &at, &state);
}

// --- what nobody classified, and the explicit pass -------------------------------------------

#[test]
fn a_tool_nobody_classified_is_refused_and_a_pass_marks_the_service_uncovered() {
    require_bin!("mcp-server-memory");
    let (_scratch, dir) = scratch("unclassified");
    let file = dir.join("memory.jsonl");
    let mut p = Proxied::start(&dir, &[], memory_server(&file));
    let r = p.call("create_entities", json!({"entities": [{"name": "x", "entityType": "t", "observations": []}]}));
    assert!(is_error(&r), "{r}");
    let t = text(&r);
    assert!(
        t.starts_with("planarian: not executed: the tool create_entities may change state that planarian cannot undo")
            && t.contains("--spec")
            && t.contains("pass = "),
        "{t}"
    );
    assert!(!file.exists(), "the server never saw the call");
    // Its reads are annotated read-only: they pass.
    assert!(!is_error(&p.call("read_graph", json!({}))));
    let pos = control(&p.control, &["position"]).unwrap();
    assert!(pos["uncovered"].is_null(), "{pos}");
    drop(p);

    // Passed by the user's choice: it reaches the server, and from then on the service is not
    // covered (a restarted proxy remembers it).
    let mut p = Proxied::start(&dir, &["--pass", "create_entities"], memory_server(&file));
    // A batch inside a batch is no message: an error, never forwarded (nor a call without id).
    let call = json!({"jsonrpc": "2.0", "id": "nested", "method": "tools/call", "params": {"name": "create_entities", "arguments": {"entities": [{"name": "nested", "entityType": "t", "observations": []}]}}});
    p.mcp.send(&json!([[call]]));
    assert_eq!(p.mcp.recv()["error"]["code"], json!(-32600));
    let mut no_id = call.clone();
    no_id.as_object_mut().unwrap().remove("id");
    p.mcp.send(&no_id);
    assert!(!is_error(&p.call("read_graph", json!({}))));
    assert!(!file.exists() || !graph(&file).contains("nested"), "neither reached the server");
    assert!(!is_error(
        &p.call("create_entities", json!({"entities": [{"name": "x", "entityType": "t", "observations": []}]}))
    ));
    assert!(graph(&file).contains("\"x\""));
    assert!(is_error(&p.call("delete_entities", json!({"entityNames": ["x"]}))), "only what was named passes");
    drop(p);
    let p = Proxied::start(&dir, &[], memory_server(&file));
    let pos = control(&p.control, &["position"]).unwrap();
    assert_eq!(pos["uncovered"], json!({"since": 0, "last": 0, "tools": ["create_entities"]}), "{pos}");
}

// --- a fork's proxy reaches nothing ------------------------------------------------------------

#[test]
fn a_disabled_proxy_starts_no_upstream_and_refuses_every_call() {
    let (_scratch, dir) = scratch("disabled");
    let marker = dir.join("started");
    let mut upstream = Command::new("/bin/sh");
    upstream.args(["-c", &format!("touch {}; exec cat", marker.display())]);
    let mut p = Proxied::start(&dir, &["--disabled", "this fork has no copy of the service"], upstream);
    assert_eq!(p.mcp.request("tools/list", json!({}))["result"], json!({"tools": []}));
    for tool in ["execute_sql", "create_entities", "read_graph"] {
        let r = p.call(tool, json!({"sql": "SELECT 1"}));
        assert!(is_error(&r) && text(&r) == "planarian: not executed: this fork has no copy of the service", "{r}");
    }
    assert!(!marker.exists(), "no upstream was started");
}

// --- MCP Toolbox with tools of its own -----------------------------------------------------------

fn tables(c: &mut postgres::Client) -> String {
    let rows = c.query("SELECT coalesce(jsonb_agg(to_jsonb(n.*) ORDER BY id), '[]')::text FROM notes n", &[]).unwrap();
    let tags =
        c.query("SELECT coalesce(jsonb_agg(to_jsonb(t.*) ORDER BY note, tag), '[]')::text FROM tags t", &[]).unwrap();
    format!("{}\n{}", rows[0].get::<_, String>(0), tags[0].get::<_, String>(0))
}

fn toolbox_config(pg: &Pg, flat: bool) -> String {
    let tools = [
        (
            "add-note",
            "INSERT INTO notes (body, owner, prio) VALUES ($1, $2, $3) RETURNING id",
            &["body", "owner", "prio"][..],
            &["string", "string", "integer"][..],
        ),
        ("rename-note", "UPDATE notes SET body = $2 WHERE id = $1", &["id", "body"], &["integer", "string"]),
        (
            "tag-notes",
            "INSERT INTO tags (note, tag) SELECT id, $2 FROM notes WHERE owner = ANY($1) ON CONFLICT DO NOTHING",
            &["owners", "tag"],
            &["array", "string"],
        ),
        ("drop-note", "DELETE FROM notes WHERE id = $1 -- not $2", &["id"], &["integer"]),
        ("list-notes", "SELECT id, body, owner FROM notes WHERE owner = $1 ORDER BY id", &["owner"], &["string"]),
        ("bump-all", "UPDATE notes SET prio = prio + 1", &[], &[]),
        ("stamp", "SELECT pg_notify('c', $1)", &["text"], &["string"]),
    ];
    let param = |n: &str, t: &str, indent: &str| {
        let items = if t == "array" {
            format!("\n{indent}  items:\n{indent}    name: x\n{indent}    type: string\n{indent}    description: x")
        } else {
            String::new()
        };
        format!("{indent}- name: {n}\n{indent}  type: {t}\n{indent}  description: the {n}{items}\n")
    };
    let templated = "SELECT * FROM {{.table}}";
    if flat {
        let mut out = format!("kind: source\nname: pg\ntype: postgres\nhost: 127.0.0.1\nport: {}\ndatabase: postgres\nuser: postgres\npassword: x\n", pg.port);
        for (name, st, ps, ts) in tools {
            out += &format!("---\nkind: tool\nname: {name}\ntype: postgres-sql\nsource: pg\ndescription: {name}\nstatement: \"{st}\"\n");
            if !ps.is_empty() {
                out += "parameters:\n";
                for (p, t) in ps.iter().zip(ts) {
                    out += &param(p, t, "");
                }
            }
        }
        out += &format!("---\nkind: tool\nname: peek\ntype: postgres-sql\nsource: pg\ndescription: peek\nstatement: \"{templated}\"\ntemplateParameters:\n{}", param("table", "string", ""));
        out
    } else {
        let mut out = format!("sources:\n  pg:\n    kind: postgres\n    host: 127.0.0.1\n    port: {}\n    database: postgres\n    user: postgres\n    password: x\ntools:\n", pg.port);
        for (name, st, ps, ts) in tools {
            out += &format!(
                "  {name}:\n    kind: postgres-sql\n    source: pg\n    description: {name}\n    statement: \"{st}\"\n"
            );
            if !ps.is_empty() {
                out += "    parameters:\n";
                for (p, t) in ps.iter().zip(ts) {
                    out += &param(p, t, "      ");
                }
            }
        }
        out += &format!("  peek:\n    kind: postgres-sql\n    source: pg\n    description: peek\n    statement: \"{templated}\"\n    templateParameters:\n{}", param("table", "string", "      "));
        out
    }
}

#[test]
fn toolbox_custom_sql_tools_are_classified_and_undone_like_sql() {
    let (Some(pgb), Some(tb)) = (pg_bin(), bin("toolbox")) else {
        eprintln!(
            "SKIPPED {}: needs PostgreSQL's server binaries and MCP Toolbox (tests/run installs them)",
            module_path!()
        );
        return;
    };
    for flat in [false, true] {
        eprintln!("--- Toolbox configuration in the {} format", if flat { "flat" } else { "map" });
        let pg = Pg::start(&pgb, if flat { "tbflat" } else { "tbmap" });
        let mut db = pg.client();
        db.batch_execute(
            "CREATE TABLE notes (id serial PRIMARY KEY, body text NOT NULL, owner text, prio int DEFAULT 0);
             CREATE TABLE tags (note int REFERENCES notes, tag text, PRIMARY KEY (note, tag));
             INSERT INTO notes (body, owner, prio) VALUES ('first', 'ann', 1), ('second', 'bob', 2);",
        )
        .unwrap();
        let (_scratch, dir) = scratch(if flat { "tbflat" } else { "tbmap" });
        let config = dir.join("tools.yaml");
        std::fs::write(&config, toolbox_config(&pg, flat)).unwrap();
        let mut server = Command::new(&tb);
        server.args(["--stdio", "--disable-version-check", "--config"]).arg(&config);
        let mut p = Proxied::start(&dir, &["--database", &pg.dsn()], server);
        // The harness sees the user's tools, not the proxy's hidden one.
        let list = p.mcp.request("tools/list", json!({}));
        let names: Vec<&str> =
            list["result"]["tools"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
        assert!(names.contains(&"add-note") && !names.iter().any(|n| n.contains("planarian")), "{names:?}");
        let hidden = p.call("planarian-execute-sql-pg", json!({"sql": "DELETE FROM notes"}));
        assert!(is_error(&hidden), "{hidden}");

        let state = || tables(&mut pg.client());
        let mut at = vec![(p.position(), state())];
        let calls = vec![
            ("add-note", json!({"body": "it's a note", "owner": "cy", "prio": 5})),
            ("rename-note", json!({"id": 1, "body": "first, renamed"})),
            ("tag-notes", json!({"owners": ["ann", "cy"], "tag": "urgent"})),
            ("bump-all", json!({})),
            ("drop-note", json!({"id": 2})),
            ("add-note", json!({"body": "$1 -- not a parameter", "owner": "dee", "prio": -1})),
        ];
        run(&mut p, &calls, &state, &mut at);
        // The answer is Toolbox's own: the new row's id.
        let added = p.call("add-note", json!({"body": "more", "owner": "ann", "prio": 0}));
        let id = db.query_one("SELECT max(id) FROM notes", &[]).unwrap().get::<_, i32>(0);
        assert_eq!(added["content"], json!([{"type": "text", "text": format!("{{\"id\":{id}}}")}]), "{added}");
        at.push((p.position(), state()));
        // Reads pass, take no position, and answer as Toolbox does.
        let before = p.position();
        let list = p.call("list-notes", json!({"owner": "ann"}));
        let mut direct = Mcp::spawn({
            let mut c = Command::new(&tb);
            c.args(["--stdio", "--disable-version-check", "--config"]).arg(&config).stderr(Stdio::null());
            c
        });
        let want = direct.request("tools/call", json!({"name": "list-notes", "arguments": {"owner": "ann"}}));
        assert_eq!(list, want["result"]);
        assert_eq!(p.position(), before);
        // What cannot be undone or classified is refused.
        let r = p.call("stamp", json!({"text": "x"}));
        assert!(is_error(&r) && text(&r).contains("pg_notify"), "{r}");
        let r = p.call("peek", json!({"table": "notes"}));
        assert!(is_error(&r) && text(&r).contains("templateParameters"), "{r}");
        assert_eq!(p.position(), before);
        back_through(&p, &at, &state);
    }
}

#[test]
fn toolbox_prebuilt_tools_are_reads_sql_or_refused() {
    let (Some(pgb), Some(tb)) = (pg_bin(), bin("toolbox")) else {
        eprintln!(
            "SKIPPED {}: needs PostgreSQL's server binaries and MCP Toolbox (tests/run installs them)",
            module_path!()
        );
        return;
    };
    let pg = Pg::start(&pgb, "prebuilt");
    pg.client().batch_execute("CREATE TABLE t (id int PRIMARY KEY)").unwrap();
    let (_scratch, dir) = scratch("prebuilt");
    let mut server = Command::new(&tb);
    server.args(["--prebuilt", "postgres", "--stdio", "--disable-version-check"]);
    for (k, v) in [
        ("POSTGRES_HOST", "127.0.0.1".to_string()),
        ("POSTGRES_PORT", pg.port.to_string()),
        ("POSTGRES_DATABASE", "postgres".into()),
        ("POSTGRES_USER", "postgres".into()),
        ("POSTGRES_PASSWORD", "x".into()),
    ] {
        server.env(k, v);
    }
    let mut p = Proxied::start(&dir, &["--database", &pg.dsn()], server);
    // Annotated read-only, read by the shipped spec, and SQL: they pass.
    for (tool, args) in [
        ("list_tables", json!({})),
        ("list_invalid_indexes", json!({})),
        ("execute_sql", json!({"sql": "INSERT INTO t VALUES (1)"})),
    ] {
        let r = p.call(tool, args);
        assert!(!is_error(&r), "{tool}: {r}");
    }
    assert_eq!(p.position(), 1, "the insert took a position");
    // Not annotated, not declared: refused.
    let r = p.call("get_query_plan", json!({"query": "SELECT 1"}));
    assert!(is_error(&r) && text(&r).contains("may change state that planarian cannot undo"), "{r}");
    control(&p.control, &["compensate", "0"]).unwrap();
    assert_eq!(pg.client().query_one("SELECT count(*) FROM t", &[]).unwrap().get::<_, i64>(0), 0);
}
