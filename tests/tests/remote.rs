//! Remote state end to end: a sandbox with an MCP service (the sidecar planarian starts with the
//! container, in front of the real DBHub MCP server and a real PostgreSQL), its files and its
//! database rows rolled back together, forks with databases of their own, and a fork whose
//! database calls are refused; a service without a database (the reference knowledge-graph
//! server, with the spec planarian ships), rolled back with the files, the statepoints a
//! rollback made unreachable marked so, and a tool let through unrecorded marked in the ledger.

use planarian_system_tests::sandbox::Ctr;
use planarian_system_tests::*;
use serde_json::{json, Value};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

mod mcp;
use mcp::*;

/// Its upstream names its database as `{dbname}`: each fork of a statepoint gets a copy of the
/// database as it was at that statepoint, written only by that fork.
#[test]
fn rollback_undoes_database_changes_with_the_files_and_forks_get_their_own_databases() {
    require_stack!();
    // DBHub under node: it starts in seconds under the guest's emulation, the Toolbox (a
    // 300 MB Go binary read over 9p) in minutes.
    let Some((node, dbhub)) = node_and_dbhub() else { return };
    let pg = Pg::start();
    let service = format!(
        "upstream = [\"{node}\", \"{dbhub}\", \"--transport\", \"stdio\", \"--dsn\", \"postgres://postgres@127.0.0.1:{port}/{{dbname}}?sslmode=disable\"]\n",
        node = node.display(),
        dbhub = dbhub.display(),
        port = pg.port
    );
    end_to_end(&pg, &service, false);
}

/// The same with the real server serving Streamable HTTP (started here, not by the sidecar),
/// and the sidecar serving the harness over HTTP too. Its URL names no database: a fork's SQL
/// calls are refused.
#[test]
fn over_streamable_http_rollback_undoes_database_changes_with_the_files_and_a_fork_is_refused() {
    require_stack!();
    let Some((node, dbhub)) = node_and_dbhub() else { return };
    let pg = Pg::start();
    let server = DbhubHttp::start(&node, &dbhub, &pg);
    let service = format!("url = \"{}\"\nhttp = \"127.0.0.1:0\"\n", server.url());
    end_to_end(&pg, &service, true);
}

/// One raw POST to the sidecar's HTTP endpoint: the status line and the body.
fn post(url: &str, body: &str) -> String {
    use std::io::Read;
    let rest = url.strip_prefix("http://").unwrap();
    let (authority, path) = rest.split_at(rest.find('/').unwrap());
    let mut s = std::net::TcpStream::connect(authority).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

fn end_to_end(pg: &Pg, service: &str, http: bool) {
    pg.psql("CREATE TABLE reports (id int PRIMARY KEY, body text NOT NULL)");
    let _conf = DropIn::new(
        "zz-mcp-test",
        &format!(
            "[mcp.services.pltest]\n{service}server = \"dbhub\"\ndatabase = \"host=127.0.0.1 port={port} user=postgres dbname=postgres\"\n",
            port = pg.port
        ),
    );
    let n = name("mcp");
    let _c = Cleanup(n.clone());
    let id = start_with_service(&n, "pltest", &[]);
    assert!(sidecar_running(&id), "the sidecar starts with the container");

    if http {
        // The sidecar's own HTTP endpoint answers an initialize with a session.
        let url = cmd(proxy_bin().to_str().unwrap(), ["url", &id]).out();
        assert!(url.starts_with("http://127.0.0.1:") && url.ends_with("/mcp"), "{url}");
        let init = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"pltest","version":"1"}}}"#;
        let resp = post(&url, init);
        assert!(resp.starts_with("HTTP/1.1 200") && resp.to_ascii_lowercase().contains("mcp-session-id:"), "{resp}");
        assert!(resp.contains("serverInfo"), "{resp}");
    }
    let mut agent = Harness::connect(&id);
    let r = agent.sql("INSERT INTO reports VALUES (1, 'first draft')");
    assert_ne!(r["isError"], json!(true), "{r}");
    let ctr = Ctr::new(&n);
    ctr.sh("echo 'first draft' > /report").ok();
    let sp1 = planarian(&["snapshot", &n]);
    sp1.ok();
    let sp1 = sp1.out();
    let m: Value = serde_json::from_str(&planarian(&["statepoint", "show", &n, &sp1]).out()).unwrap();
    let rs = &m["remote-state"][0];
    assert_eq!(rs["mcp-call-position"], json!(1), "{m}");
    assert!(rs["hook-path"].as_str().unwrap().ends_with("planarian-mcp-proxy"), "{m}");

    // The agent goes on: more rows, a changed row, a changed file.
    for q in ["UPDATE reports SET body = 'rewritten' WHERE id = 1", "INSERT INTO reports VALUES (2, 'appendix')"] {
        let r = agent.sql(q);
        assert_ne!(r["isError"], json!(true), "{q}: {r}");
    }
    ctr.sh("echo rewritten > /report").ok();
    assert_eq!(pg.psql("SELECT count(*) FROM reports"), "2");

    planarian(&["rollback", &n, &sp1]).ok();
    assert_eq!(ctr.sh("cat /report").out(), "first draft");
    assert_eq!(pg.psql("SELECT id || ':' || body FROM reports ORDER BY id"), "1:first draft");
    assert_eq!(pg.psql("SELECT count(*) FROM planarian.undo WHERE position > 1"), "0");
    // The sandbox and its database calls go on after the rollback.
    let r = agent.sql("INSERT INTO reports VALUES (3, 'after rollback')");
    assert_ne!(r["isError"], json!(true), "{r}");

    // A write issued while an asynchronous snapshot is being taken waits for it (the sidecar
    // takes the sandbox's lock shared): its position is after the statepoint's, so a rollback
    // to that statepoint undoes it. (The sidecar's lock, whatever its upstream's transport: over
    // stdio only, a snapshot and a rollback fewer under emulation)
    if !http {
        async_snapshot_and_a_write_meanwhile(pg, &n, &mut agent);
    }
    let rows = |db: &str| pg.psql_in(db, "SELECT string_agg(id || ':' || body, ',' ORDER BY id) FROM reports");
    let source_rows = rows("postgres");
    assert_eq!(source_rows, "1:first draft,3:after rollback");
    // Forks of sp1: their own sandboxes. With a service that names its database, each gets its
    // own copy of the database as it was at sp1; without, no calls into the source's database.
    let branches = !http;
    let branch_dbs = || pg.psql("SELECT count(*) FROM pg_database WHERE datname LIKE 'postgres\\_%'");
    if branches {
        // A fork that fails after its database was branched leaves no database behind.
        std::fs::write("/run/planarian/fault", "fork.linked").unwrap();
        let r = planarian(&["fork", &n, &sp1, "--name", &name("mcp-fork-failed")]);
        let _ = std::fs::remove_file("/run/planarian/fault");
        assert!(r.code != Some(0) && r.stderr.contains("injected fault at fork.linked"), "{r:?}");
        assert_eq!(branch_dbs(), "0", "the failed fork's database is dropped");
    }
    // A fork of sp1 (one: its own database against the source's; each fork's is named by its
    // ID. A second fork costs a DBHub start, a minute under emulation)
    let f = name("mcp-fork-a");
    let _fork_cleanup = Cleanup(f.clone());
    planarian(&["fork", &n, &sp1, "--name", &f]).ok();
    let fid = podman("planarian", &["inspect", "--format", "{{.Id}}", &f]).out();
    assert_eq!(Ctr::new(&f).sh("cat /report").out(), "first draft");
    let mut forked = Harness::connect(&fid);
    let db = format!("postgres_{}", &fid[..12]);
    if branches {
        assert_eq!(rows(&db), "1:first draft", "the fork's database is the source's at {sp1}");
        let r = forked.sql("INSERT INTO reports VALUES (10, 'fork a')");
        assert_ne!(r["isError"], json!(true), "{r}");
    } else {
        let r = forked.sql("DELETE FROM reports");
        assert_eq!(r["isError"], json!(true), "{r}");
        assert!(r["content"][0]["text"].as_str().unwrap().contains("fork"), "{r}");
        let fm: Value =
            serde_json::from_str(&planarian(&["statepoint", "list", &f, "--json"]).out()).unwrap_or(Value::Null);
        if let Some(list) = fm.as_array() {
            assert!(list.iter().all(|s| s["remote-state"].as_array().is_none_or(|a| a.is_empty())), "{fm}");
        }
    }
    assert_eq!(rows("postgres"), source_rows, "the source never sees a fork's calls");
    if branches {
        assert_eq!(rows(&db), "1:first draft,10:fork a", "the fork sees only its own rows");
        // A fork's rollback to its first statepoint undoes its own calls, in its own database.
        let list: Value = serde_json::from_str(&planarian(&["statepoint", "list", &f, "--json"]).ok().out()).unwrap();
        assert!(
            list[0]["remote-state"][0]["mcp-call-position"].is_u64(),
            "the fork's first statepoint holds its branch's position: {list}"
        );
        let first = list[0]["statepoint-id"].as_str().unwrap().to_string();
        planarian(&["rollback", &f, &first]).ok();
        assert_eq!(rows(&db), "1:first draft");
        let r = forked.sql("INSERT INTO reports VALUES (11, 'fork a, after its rollback')");
        assert_ne!(r["isError"], json!(true), "{r}");
        assert_eq!(rows(&db), "1:first draft,11:fork a, after its rollback");
        assert_eq!(rows("postgres"), source_rows);
    }
    // The source's sidecar is untouched.
    let r = agent.sql("SELECT count(*) FROM reports");
    assert_ne!(r["isError"], json!(true), "{r}");

    // Sidecars stop with their containers (a fork's database stays until dropped).
    drop(agent);
    podman("planarian", &["rm", "-f", "-t", "0", &n]).ok();
    drop(forked);
    podman("planarian", &["rm", "-f", "-t", "0", &f]).ok();
    if branches {
        pg.psql(&format!("DROP DATABASE \"{db}\" WITH (FORCE)"));
    }
    let ids = [id, fid];
    assert!(
        wait_for(Duration::from_secs(120), || ids.iter().all(|i| !sidecar_running(i))),
        "the sidecars stop with their containers"
    );
}

/// The asynchronous snapshot of `end_to_end`, with a write issued while it is taken.
fn async_snapshot_and_a_write_meanwhile(pg: &Pg, n: &str, agent: &mut Harness) {
    let sp2 = planarian(&["snapshot", n, "--async"]).ok().out();
    let r = agent.sql("INSERT INTO reports VALUES (4, 'during the snapshot')");
    assert_ne!(r["isError"], json!(true), "{r}");
    planarian(&["statepoint", "wait", n, &sp2]).ok();
    let m2: Value = serde_json::from_str(&planarian(&["statepoint", "show", n, &sp2]).out()).unwrap();
    let p2 = m2["remote-state"][0]["mcp-call-position"].as_u64().unwrap();
    // Since its parent (sp1, after the rollback to it), one call on this branch changed reports;
    // the two a rollback undid do not count.
    assert_eq!(m2["remote-state"][0]["calls-since-parent"], json!(1), "{m2}");
    assert_eq!(m2["remote-state"][0]["tables-since-parent"], json!(["reports"]), "{m2}");
    let ledger = planarian(&["ledger", n]).out();
    assert!(ledger.contains("1 remote call since its parent: reports"), "{ledger}");
    assert_eq!(
        pg.psql(&format!("SELECT count(DISTINCT position) FROM planarian.undo WHERE position > {p2}")),
        "1",
        "the write landed after {sp2}: {m2}"
    );
    planarian(&["rollback", n, &sp2]).ok();
    assert_eq!(pg.psql("SELECT string_agg(id::text, ',' ORDER BY id) FROM reports"), "1,3");
}

/// The knowledge graph in its file, taken as sets (the server's own model).
fn graph(file: &Path) -> String {
    let mut lines: Vec<String> = std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(String::from)
        .collect();
    lines.sort();
    lines.join("\n")
}

/// A service whose state is not a database: the reference knowledge-graph server from npm,
/// with the spec planarian ships for it. Its calls are undone with the sandbox's files; the
/// statepoint left behind, whose calls were undone, is marked so and refused as a target; a
/// fork reaches nothing of it. A second service lets a tool through unrecorded: the ledger says
/// its statepoints do not cover it.
#[test]
fn a_knowledge_graph_is_rolled_back_with_the_files_and_what_was_undone_is_not_offered_again() {
    require_stack!();
    let Some((node, _)) = node_and_dbhub() else { return };
    let server = repo().join("target/npm/node_modules/@modelcontextprotocol/server-memory/dist/index.js");
    assert!(server.exists(), "{}: tests/run installs it", server.display());
    let file = PathBuf::from(format!("/tmp/pltest-memory-{}.jsonl", std::process::id()));
    let raw = PathBuf::from(format!("/tmp/pltest-memory-raw-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&file);
    let _ = std::fs::remove_file(&raw);
    let _conf = DropIn::new(
        "zz-mcp-memory",
        &format!(
            "[mcp.services.pltest-memory]\nupstream = [\"{node}\", \"{server}\"]\nspecs = [\"memory\"]\nenv = {{ MEMORY_FILE_PATH = \"{file}\" }}\n\
             [mcp.services.pltest-raw]\nupstream = [\"{node}\", \"{server}\"]\npass = [\"create_entities\"]\nenv = {{ MEMORY_FILE_PATH = \"{raw}\" }}\n",
            node = node.display(),
            server = server.display(),
            file = file.display(),
            raw = raw.display()
        ),
    );
    let n = name("kg");
    let _c = Cleanup(n.clone());
    let id = start_with_service(&n, "pltest-memory", &[]);
    let mut agent = Harness::connect(&id);
    let ok = |r: &Value| assert_ne!(r["isError"], json!(true), "{r}");
    let e = |name: &str, obs: &[&str]| json!({"name": name, "entityType": "person", "observations": obs});
    let ctr = Ctr::new(&n);
    ok(&agent.call("create_entities", json!({"entities": [e("ann", &["likes tea"])]})));
    ctr.sh("echo one > /notes").ok();
    let sp1 = planarian(&["snapshot", &n, "--name", "one-entity"]).ok().out();
    let at_sp1 = graph(&file);
    ok(&agent.call("add_observations", json!({"observations": [{"entityName": "ann", "contents": ["plays chess"]}]})));
    ok(&agent.call("create_entities", json!({"entities": [e("bob", &[])]})));
    ok(&agent.call("create_relations", json!({"relations": [{"from": "ann", "to": "bob", "relationType": "knows"}]})));
    ctr.sh("echo two > /notes").ok();
    let sp2 = planarian(&["snapshot", &n, "--name", "two-entities"]).ok().out();
    let m2: Value = serde_json::from_str(&planarian(&["statepoint", "show", &n, &sp2]).out()).unwrap();
    assert_eq!(m2["remote-state"][0]["calls-since-parent"], json!(3), "{m2}");
    ok(&agent.call("delete_entities", json!({"entityNames": ["ann"]})));
    assert!(!graph(&file).contains("\"ann\""));

    planarian(&["rollback", &n, &sp1]).ok();
    let r = planarian(&["statepoint", "context", &n]).ok().out();
    assert_eq!(ctr.sh("cat /notes").out(), "one");
    assert_eq!(graph(&file), at_sp1, "the graph is as it was at {sp1}");
    assert!(r.contains(&format!("no longer restorable (the MCP calls they hold were undone): {sp2}")), "{r}");
    let ledger = planarian(&["ledger", &n]).out();
    assert!(ledger.lines().any(|l| l.contains(&sp2) && l.contains("no longer restorable")), "{ledger}");
    let again = planarian(&["rollback", &n, &sp2]);
    assert!(
        again.code != Some(0) && again.stderr.contains(&format!("statepoint {sp2} can no longer be restored")),
        "{again:?}"
    );
    assert_eq!(graph(&file), at_sp1, "a refused rollback changes nothing");
    assert_eq!(ctr.sh("cat /notes").out(), "one");

    // A fork has no copy of the graph: its sidecar reaches nothing of it.
    let f = name("kg-fork");
    let _cf = Cleanup(f.clone());
    planarian(&["fork", &n, &sp1, "--name", &f]).ok();
    let fid = podman("planarian", &["inspect", "--format", "{{.Id}}", &f]).out();
    let mut forked = Harness::connect(&fid);
    for tool in ["create_entities", "read_graph"] {
        let r = forked.call(tool, json!({"entities": [e("mallory", &[])]}));
        assert_eq!(r["isError"], json!(true), "{r}");
        assert!(r["content"][0]["text"].as_str().unwrap().contains("fork"), "{r}");
    }
    assert_eq!(graph(&file), at_sp1, "the fork changed nothing of the source's graph");
    drop(forked);

    // A tool let through unrecorded: the statepoints after it say they do not cover it.
    let raw_n = name("kg-raw");
    let _cr = Cleanup(raw_n.clone());
    let raw_id = start_with_service(&raw_n, "pltest-raw", &[]);
    let mut raw_agent = Harness::connect(&raw_id);
    let before = planarian(&["snapshot", &raw_n]).ok().out();
    ok(&raw_agent.call("create_entities", json!({"entities": [e("zed", &[])]})));
    let refused = raw_agent.call("delete_entities", json!({"entityNames": ["zed"]}));
    assert!(
        refused["isError"] == json!(true)
            && refused["content"][0]["text"].as_str().unwrap().contains("may change state that planarian cannot undo"),
        "{refused}"
    );
    let after = planarian(&["snapshot", &raw_n]).ok().out();
    let ledger = planarian(&["ledger", &raw_n]).out();
    assert!(
        ledger.lines().any(|l| l.contains(&after) && l.contains("remote state NOT covered: create_entities")),
        "{ledger}"
    );
    assert!(!ledger.lines().any(|l| l.contains(&before) && l.contains("NOT covered")), "{ledger}");
    // Back to before the pass: what the passed call did is not undone, and the context says so.
    planarian(&["rollback", &raw_n, &before]).ok();
    let r = planarian(&["statepoint", "context", &raw_n]).ok().out();
    assert!(r.contains("Remote state NOT restored: create_entities let through unrecorded"), "{r}");
    assert!(graph(&raw).contains("\"zed\""), "the passed call was not undone");
    drop(raw_agent);
    drop(agent);
    let _ = std::fs::remove_file(&file);
    let _ = std::fs::remove_file(&raw);
}
