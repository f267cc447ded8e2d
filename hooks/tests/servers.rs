//! The MCP state proxy against a throwaway real PostgreSQL and two real MCP servers: Google's
//! MCP Toolbox for Databases (its `execute_sql` runs one statement per call, as a prepared
//! statement) and DBHub (several statements per call, in one transaction).
//!
//! Needs PostgreSQL's server binaries (`PLANARIAN_PG_BIN`, default /usr/lib/postgresql/15/bin)
//! and the servers (target/npm/node_modules/.bin/{toolbox,dbhub}, installed by tests/run).
//! Without them the tests say SKIPPED loudly; tests/run installs them, so in CI nothing is
//! skipped.

mod common;

use common::{control, pg_bin, root, wait_until, Mcp, Pg};
use postgres::{Client, NoTls};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

#[derive(Clone, Debug)]
enum Srv {
    Toolbox(PathBuf),
    Dbhub(PathBuf),
}

fn servers() -> Option<Vec<Srv>> {
    let bin = root().join("target/npm/node_modules/.bin");
    let (tb, dh) = (bin.join("toolbox"), bin.join("dbhub"));
    (tb.exists() && dh.exists()).then(|| vec![Srv::Toolbox(tb), Srv::Dbhub(dh)])
}

macro_rules! require {
    () => {
        match (pg_bin(), servers()) {
            (Some(pg), Some(srv)) => (pg, srv),
            (pg, tb) => {
                eprintln!(
                    "SKIPPED {}: needs PostgreSQL server binaries ({}) and MCP Toolbox + DBHub ({}); tests/run installs them",
                    module_path!(),
                    if pg.is_some() { "found" } else { "missing" },
                    if tb.is_some() { "found" } else { "missing" }
                );
                return;
            }
        }
    };
}

fn server_cmd(srv: &Srv, pg: &Pg) -> Command {
    match srv {
        Srv::Toolbox(tb) => {
            let mut c = Command::new(tb);
            c.args(["--prebuilt", "postgres", "--stdio", "--disable-version-check"])
                .env("POSTGRES_HOST", "127.0.0.1")
                .env("POSTGRES_PORT", pg.port.to_string())
                .env("POSTGRES_DATABASE", "postgres")
                .env("POSTGRES_USER", "postgres")
                .env("POSTGRES_PASSWORD", "unused")
                .stderr(Stdio::null());
            c
        }
        Srv::Dbhub(dh) => {
            let mut c = Command::new(dh);
            c.args([
                "--transport",
                "stdio",
                "--dsn",
                &format!("postgres://postgres@127.0.0.1:{}/postgres?sslmode=disable", pg.port),
            ])
            .stderr(Stdio::null());
            c
        }
    }
}

struct Proxied {
    mcp: Mcp,
    control: PathBuf,
    state: PathBuf,
    _scratch: tempfile::TempDir,
}

fn proxy(srv: &Srv, pg: &Pg, tag: &str) -> Proxied {
    let (c, control, state, scratch) = proxy_cmd(srv, pg, tag);
    Proxied { mcp: Mcp::spawn(c), control, state, _scratch: scratch }
}

/// The proxy's command in front of `srv`, its control socket and positions file, in a scratch
/// directory removed when the last is dropped.
fn proxy_cmd(srv: &Srv, pg: &Pg, tag: &str) -> (Command, PathBuf, PathBuf, tempfile::TempDir) {
    let kind = if matches!(srv, Srv::Dbhub(_)) { "dbhub" } else { "toolbox" };
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path().join(format!("{tag}-{kind}"));
    std::fs::create_dir_all(&dir).unwrap();
    let (c, control, state) = proxy_cmd_in(srv, pg, &dir);
    (c, control, state, scratch)
}

/// The proxy's command in front of `srv`, its control socket and positions file in `dir`.
fn proxy_cmd_in(srv: &Srv, pg: &Pg, dir: &Path) -> (Command, PathBuf, PathBuf) {
    let kind = if matches!(srv, Srv::Dbhub(_)) { "dbhub" } else { "toolbox" };
    let (control, state) = (dir.join("control.sock"), dir.join("positions.json"));
    let tbc = server_cmd(srv, pg);
    let mut c = Command::new(env!("CARGO_BIN_EXE_planarian-mcp-proxy"));
    c.args(["serve", "--server", kind, "--database", &pg.dsn(), "--control"])
        .arg(&control)
        .arg("--state")
        .arg(&state)
        .arg("--")
        .arg(tbc.get_program());
    c.args(tbc.get_args());
    for (k, v) in tbc.get_envs() {
        c.env(k, v.unwrap());
    }
    (c, control, state)
}

/// Every user table, whole, in key order: what the tests compare.
fn dump(c: &mut Client) -> String {
    dump_tables(c, "")
}

/// Every relation of the schema, each holding only its own rows (`FROM ONLY`: a parent's dump
/// does not repeat its children's rows, partitions are listed on their own).
fn dump_only(c: &mut Client) -> String {
    dump_tables(c, "ONLY ")
}

fn dump_tables(c: &mut Client, only: &str) -> String {
    let tables: Vec<String> = c
        .query(
            "SELECT format('%I.%I', schemaname, tablename) FROM pg_tables WHERE schemaname = 'public' ORDER BY 1",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut out = String::new();
    for t in tables {
        let rows = c
            .query(&format!("SELECT coalesce(jsonb_agg(to_jsonb(x.*) ORDER BY to_jsonb(x.*)::text), '[]')::text FROM {only}{t} x"), &[])
            .unwrap();
        out += &format!("{t}: {}\n", rows[0].get::<_, String>(0));
    }
    out
}

/// Sends each call through the proxy (none may be refused) and notes, after each, the position
/// and every table (`dump`).
fn record(
    p: &mut Proxied,
    db: &mut Client,
    calls: &[&str],
    dump: fn(&mut Client) -> String,
    at: &mut Vec<(u64, String)>,
) {
    for q in calls {
        let r = p.mcp.sql(q);
        assert_ne!(r["isError"], json!(true), "{q}: {r}");
        let pos = control(&p.control, &["position"]).unwrap()["position"].as_u64().unwrap();
        at.push((pos, dump(db)));
    }
}

/// Compensates back to every earlier position noted, newest first: each time every table must
/// be exactly as it was when that position was current.
fn back_through(p: &Proxied, db: &mut Client, at: &[(u64, String)], dump: fn(&mut Client) -> String) {
    for (pos, want) in at.iter().rev().skip(1) {
        let r = control(&p.control, &["compensate", &pos.to_string()]).unwrap();
        assert_eq!(r["position"].as_u64(), Some(*pos));
        assert_eq!(&dump(db), want, "after compensating to position {pos}");
    }
}

fn schema(c: &mut Client) {
    c.batch_execute(
        "CREATE TABLE accounts (id int PRIMARY KEY, owner text NOT NULL, balance numeric NOT NULL, tags text[], meta jsonb);
         CREATE TABLE orders (order_no bigint GENERATED BY DEFAULT AS IDENTITY, region text, item text, qty int,
                              PRIMARY KEY (region, order_no));
         CREATE TABLE notes (id serial PRIMARY KEY, body text, created timestamptz DEFAULT now());
         INSERT INTO accounts VALUES (1, 'ann', 100, '{a}', '{\"k\": 1}'), (2, 'bob', 50, NULL, NULL), (3, 'cy', 0, '{}', '[]');
         INSERT INTO orders (region, item, qty) VALUES ('eu', 'pen', 1), ('us', 'ink', 2);",
    )
    .unwrap();
}

#[test]
fn compensate_to_every_earlier_position_restores_every_table_exactly() {
    let (bin, servers) = require!();
    for srv in &servers {
        every_position(&bin, srv);
    }
}

fn every_position(bin: &Path, srv: &Srv) {
    eprintln!("--- {srv:?}");
    let pg = Pg::start(bin, "every");
    let mut db = pg.client();
    schema(&mut db);
    let mut p = proxy(srv, &pg, "every");
    let start = control(&p.control, &["position"]).unwrap()["position"].as_u64().unwrap();
    let mut at = vec![(start, dump(&mut db))];
    let session = [
        "INSERT INTO accounts VALUES (4, 'dee', 10, '{x,y}', '{\"n\": [1, 2]}')",
        "UPDATE accounts SET balance = balance + 5 WHERE id IN (1, 2)",
        "SELECT * FROM accounts",
        "DELETE FROM accounts WHERE id = 3",
        "INSERT INTO accounts VALUES (2, 'bob', 0, NULL, NULL), (5, 'eve', 7, NULL, NULL) ON CONFLICT (id) DO UPDATE SET balance = excluded.balance, owner = 'bob2'",
        "INSERT INTO orders (region, item, qty) VALUES ('eu', 'cap', 3) RETURNING order_no",
        "UPDATE orders SET qty = qty * 10 WHERE region = 'eu'",
        "INSERT INTO notes (body) VALUES ('first'), ('second')",
        "WITH moved AS (DELETE FROM notes WHERE body = 'second' RETURNING id, body) INSERT INTO accounts (id, owner, balance) SELECT 100 + id, body, 0 FROM moved",
        "WITH bumped AS (UPDATE accounts SET balance = balance + 1 WHERE id = 1 RETURNING id) SELECT count(*) AS n FROM bumped",
        "UPDATE ONLY accounts AS a SET meta = jsonb_build_object('seen', true) FROM orders o WHERE o.region = 'us' AND a.id = o.qty",
        "DELETE FROM notes WHERE body = 'first' RETURNING *",
        "INSERT INTO accounts VALUES (6, 'fay', 1, NULL, NULL) ON CONFLICT DO NOTHING",
        "DELETE FROM orders",
        "CREATE TABLE projects (id int PRIMARY KEY, name text)",
        "INSERT INTO projects VALUES (1, 'p1'), (2, 'p2')",
        "ALTER TABLE accounts ADD COLUMN region text DEFAULT 'eu'",
        "UPDATE accounts SET region = 'us' WHERE id = 1",
        "UPDATE accounts SET id = id + 1000 WHERE id IN (1, 2) RETURNING id, owner",
        "UPDATE accounts SET balance = 1 WHERE id = 1002",
        "CREATE INDEX projects_name ON projects (name)",
        "CREATE VIEW rich AS SELECT * FROM accounts WHERE balance > 10",
        "CREATE TABLE IF NOT EXISTS projects (id int PRIMARY KEY)",
        "CREATE TABLE rich_accounts AS SELECT id, owner, balance FROM accounts WHERE balance > 10",
        "SELECT region, item INTO order_copy FROM orders",
        "CREATE TABLE IF NOT EXISTS rich_accounts AS SELECT 1 AS id",
    ];
    // DBHub takes several statements in one call: one position, undone as a unit.
    let several = ["INSERT INTO notes (body) VALUES ('m1'); UPDATE accounts SET balance = 0 WHERE id = 1; SELECT 1; DELETE FROM notes WHERE body = 'second'"];
    let extra: &[&str] = if matches!(srv, Srv::Dbhub(_)) { &several } else { &[] };
    // The CREATE … IF NOT EXISTS of an existing table creates nothing: no position.
    let writes = 23 + extra.len() as u64;
    let calls: Vec<&str> = session.iter().chain(extra).copied().collect();
    record(&mut p, &mut db, &calls, dump, &mut at);
    // Reads are not numbered: 11 writes.
    assert_eq!(at.last().unwrap().0, start + writes);
    assert_ne!(at.last().unwrap().1, at[0].1);
    // Back through every earlier position, newest first; each time every table is exactly as it
    // was when that position was current.
    back_through(&p, &mut db, &at, dump);
    let undo: i64 = db.query_one("SELECT count(*) FROM planarian.undo", &[]).unwrap().get(0);
    assert_eq!(undo, 0, "each compensation consumes its undo rows");
    let gone: bool = db
        .query_one("SELECT to_regclass('projects') IS NULL AND to_regclass('rich') IS NULL AND to_regclass('rich_accounts') IS NULL AND to_regclass('order_copy') IS NULL", &[])
        .unwrap()
        .get(0);
    assert!(gone, "what the agent created is gone");
    // Forward again, then back to the middle: new calls get new positions.
    p.mcp.sql("UPDATE accounts SET owner = 'ANN' WHERE id = 1");
    let mid = control(&p.control, &["position"]).unwrap()["position"].as_u64().unwrap();
    assert!(mid > start + writes, "positions are never reused: {mid}");
    let before_mid = dump(&mut db);
    p.mcp.sql("DELETE FROM accounts WHERE id = 2");
    control(&p.control, &["compensate", &mid.to_string()]).unwrap();
    assert_eq!(dump(&mut db), before_mid);
    // A position whose calls were undone can no longer be reached.
    let err = control(&p.control, &["compensate", &(start + 5).to_string()]).unwrap_err();
    assert!(err.contains("can no longer be restored"), "{err}");
    drop(p);
}

#[test]
fn results_are_exactly_what_the_original_statement_returns() {
    let (bin, servers) = require!();
    for srv in &servers {
        same_results(&bin, srv);
    }
}

fn same_results(bin: &Path, srv: &Srv) {
    let pg = Pg::start(bin, "same");
    let mut db = pg.client();
    schema(&mut db);
    let mut p = proxy(srv, &pg, "same");
    let mut direct = Mcp::spawn(server_cmd(srv, &pg));
    let several = ["SELECT 1 AS one; UPDATE accounts SET balance = balance WHERE id = 3; UPDATE accounts SET owner = owner WHERE id < 3 RETURNING id"];
    let extra: &[&str] = if matches!(srv, Srv::Dbhub(_)) { &several } else { &[] };
    for q in extra.iter().copied().chain([
        "UPDATE accounts SET balance = balance WHERE id <= 2 RETURNING *",
        "UPDATE accounts a SET owner = owner WHERE a.id = 1 RETURNING a.owner, balance * 2, upper(owner), id AS key, tags::text",
        "UPDATE accounts SET balance = balance WHERE id = 99 RETURNING id",
        "UPDATE accounts SET balance = balance WHERE id = 1",
        "DELETE FROM accounts WHERE id = 99",
        "WITH b AS (UPDATE accounts SET balance = balance WHERE id <= 2 RETURNING id, owner) SELECT * FROM b ORDER BY id",
        "WITH b AS (UPDATE accounts SET balance = balance WHERE id = 3) UPDATE orders SET qty = qty WHERE region = 'eu' RETURNING item",
    ]) {
        let via = p.mcp.sql(q);
        let dir = direct.sql(q);
        assert_eq!(via, dir, "{q}");
    }
}

#[test]
fn uncompensable_calls_are_refused_before_execution_and_change_nothing() {
    let (bin, servers) = require!();
    for srv in &servers {
        refusals(&bin, srv);
    }
}

fn refusals(bin: &Path, srv: &Srv) {
    let pg = Pg::start(bin, "refuse");
    let mut db = pg.client();
    schema(&mut db);
    db.batch_execute(
        "CREATE TABLE nokey (a int, b text); INSERT INTO nokey VALUES (1, 'x');
         CREATE TABLE child (id int PRIMARY KEY, acc int REFERENCES accounts ON DELETE CASCADE);
         CREATE TABLE audited (id int PRIMARY KEY, v int);
         CREATE FUNCTION bump() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NEW; END $$;
         CREATE TRIGGER audit BEFORE UPDATE ON audited FOR EACH ROW EXECUTE FUNCTION bump();
         CREATE SEQUENCE s;
         CREATE FUNCTION sneaky() RETURNS int LANGUAGE sql VOLATILE AS $$ DELETE FROM nokey RETURNING 1 $$;
         CREATE VIEW v_exists AS SELECT 1 AS x;",
    )
    .unwrap();
    let before = dump(&mut db);
    let mut p = proxy(srv, &pg, "refuse");
    for (q, want) in [
        ("TRUNCATE accounts", "TRUNCATE"),
        ("DROP TABLE accounts CASCADE", "DROP"),
        ("DO $$ BEGIN DELETE FROM accounts; END $$", "DO blocks"),
        ("COPY accounts FROM STDIN", "COPY"),
        ("BEGIN", "transaction control"),
        ("DELETE FROM nokey", "no primary key"),
        ("DELETE FROM accounts WHERE id = 1", "cascades"),
        ("UPDATE audited SET v = 1", "trigger audit"),
        ("INSERT INTO orders (region, item, qty) VALUES ('eu', 'x', nextval('s'))", "nextval"),
        ("SELECT sneaky()", "sneaky"),
        ("CREATE TABLE side_effects AS SELECT sneaky() AS n", "sneaky"),
        ("INSERT INTO orders (region, order_no, item, qty) VALUES ('eu', 1, 'x', 1) ON CONFLICT (region, order_no) DO UPDATE SET region = 'xx'", "changes the primary key column region"),
        ("WITH d AS (DELETE FROM orders WHERE qty = 1 RETURNING *) DELETE FROM orders WHERE qty = 2", "two parts of the statement change public.orders"),
        ("DELETE FROM planarian.undo", "undo log"),
        ("ALTER TABLE accounts DROP COLUMN tags", "only ADD COLUMN"),
        ("CREATE INDEX ON accounts (owner)", "name the index"),
        ("CREATE OR REPLACE VIEW v_exists AS SELECT 2 AS x", "cannot be undone"),
        ("INSERT INTO orders (region, item, qty) VALUES ('eu', 'a', 1); TRUNCATE accounts", if matches!(srv, Srv::Dbhub(_)) { "statement 2" } else { "one SQL statement per call" }),
    ] {
        let r = p.mcp.sql(q);
        assert_eq!(r["isError"], json!(true), "{q}: {r}");
        let text = r["content"][0]["text"].as_str().unwrap();
        assert!(text.starts_with("planarian: not executed: ") && text.contains(want), "{q}: {text}");
    }
    assert_eq!(dump(&mut db), before);
    assert_eq!(control(&p.control, &["status"]).unwrap()["last"].as_u64(), Some(0), "refusals take no position");
    // Passing through what the proxy does not understand: other tools, unknown methods.
    let tools = p.mcp.request("tools/list", json!({}));
    assert!(tools["result"]["tools"].as_array().is_some_and(|t| !t.is_empty()), "{tools}");
    let unknown = p.mcp.request("no/such/method", json!({}));
    assert!(unknown["error"].is_object(), "{unknown}");
}

/// Inheritance children, a grandchild with a row whose key its parent also has, and a
/// partitioned table: what a statement on the parent reaches.
fn hierarchy(c: &mut Client) {
    c.batch_execute(
        "CREATE TABLE items (id int PRIMARY KEY, name text);
         CREATE TABLE special_items (extra text, PRIMARY KEY (id)) INHERITS (items);
         CREATE TABLE rare_items (grade int, PRIMARY KEY (id)) INHERITS (special_items);
         INSERT INTO items VALUES (1, 'i1'), (2, 'i2');
         INSERT INTO special_items VALUES (1, 's1 (same id as i1)', 'x1'), (3, 's3', 'x3'), (4, 's4', 'x4');
         INSERT INTO rare_items VALUES (5, 'r5', 'x5', 55);
         CREATE TABLE measures (id int, region text, v int, PRIMARY KEY (region, id)) PARTITION BY LIST (region);
         CREATE TABLE measures_eu PARTITION OF measures FOR VALUES IN ('eu');
         CREATE TABLE measures_us PARTITION OF measures FOR VALUES IN ('us') PARTITION BY RANGE (id);
         CREATE TABLE measures_us_low PARTITION OF measures_us FOR VALUES FROM (0) TO (100);
         CREATE TABLE measures_us_high PARTITION OF measures_us FOR VALUES FROM (100) TO (1000);
         INSERT INTO measures VALUES (1, 'eu', 10), (2, 'us', 20), (3, 'eu', 30), (200, 'us', 2000);
         CREATE TABLE loose (id int PRIMARY KEY, v int);
         CREATE TABLE loose_child () INHERITS (loose);
         INSERT INTO loose VALUES (1, 1); INSERT INTO loose_child VALUES (1, 10), (1, 11);
         CREATE TABLE watched (id int, region text, PRIMARY KEY (region, id)) PARTITION BY LIST (region);
         CREATE TABLE watched_eu PARTITION OF watched FOR VALUES IN ('eu');
         CREATE FUNCTION keep() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NEW; END $$;
         CREATE TRIGGER stamp BEFORE UPDATE ON watched_eu FOR EACH ROW EXECUTE FUNCTION keep();",
    )
    .unwrap();
}

#[test]
fn rows_of_inheritance_children_and_partitions_are_undone_into_the_relation_they_lived_in() {
    let (bin, servers) = require!();
    for srv in &servers {
        children_and_partitions(&bin, srv);
    }
}

fn children_and_partitions(bin: &Path, srv: &Srv) {
    eprintln!("--- {srv:?}");
    let pg = Pg::start(bin, "inherit");
    let mut db = pg.client();
    hierarchy(&mut db);
    let mut p = proxy(srv, &pg, "inherit");
    let start = control(&p.control, &["position"]).unwrap()["position"].as_u64().unwrap();
    let mut at = vec![(start, dump_only(&mut db))];
    let calls = [
        // Reaches items 1, special 1 and 3, rare 5: each must come back where it was, whole.
        "DELETE FROM items WHERE id IN (1, 3, 5)",
        "UPDATE items SET name = upper(name) WHERE id IN (2, 4)",
        "UPDATE special_items SET extra = 'changed', name = 'n' WHERE id = 4",
        "INSERT INTO items VALUES (6, 'i6')",
        "INSERT INTO items VALUES (4, 'i4') ON CONFLICT (id) DO UPDATE SET name = 'i4b'",
        "DELETE FROM ONLY items WHERE id = 2",
        "INSERT INTO measures VALUES (4, 'us', 40), (5, 'eu', 50), (300, 'us', 3)",
        "UPDATE measures SET v = v + 1 WHERE id < 250",
        "DELETE FROM measures WHERE id IN (1, 2, 200)",
        "DELETE FROM ONLY loose WHERE id = 1",
        "UPDATE items SET name = name || '!' RETURNING id, name",
        // Key values changed: a row moving to another partition, rows of a parent and its child.
        "UPDATE measures SET region = 'us', id = id + 500 WHERE id = 3",
        "UPDATE items SET id = id * 10 WHERE id = 4",
        "UPDATE special_items SET name = 'after the move' WHERE id = 40",
    ];
    record(&mut p, &mut db, &calls, dump_only, &mut at);
    // What cannot be told apart or has effects of its own is refused before execution.
    let before = dump_only(&mut db);
    for (q, want) in [
        ("DELETE FROM loose WHERE id = 1", "child table public.loose_child has no primary key"),
        ("UPDATE watched SET id = id", "trigger stamp runs on public.watched_eu (a partition of it)"),
    ] {
        let r = p.mcp.sql(q);
        let text = r["content"][0]["text"].as_str().unwrap_or_default();
        assert!(r["isError"] == json!(true) && text.contains(want), "{q}: {r}");
    }
    assert_eq!(dump_only(&mut db), before, "a refusal changes nothing");
    back_through(&p, &mut db, &at, dump_only);
    drop(p);
}

#[test]
fn kept_catalog_answers_never_outlive_a_ddl_made_behind_the_proxy() {
    let (bin, servers) = require!();
    for srv in &servers {
        ddl_behind(&bin, srv, None);
    }
    ddl_behind(&bin, &servers[0], Some("agent"));
}

/// `as_user`: the proxy's own connection as a role that is no superuser, so it cannot create
/// the event triggers that count DDL: it then asks the catalog at every write.
fn ddl_behind(bin: &Path, srv: &Srv, as_user: Option<&str>) {
    eprintln!("--- {srv:?} as {as_user:?}");
    let pg = Pg::start(bin, "behind");
    let mut db = pg.client();
    hierarchy(&mut db);
    let mut p = match as_user {
        None => proxy(srv, &pg, "behind"),
        Some(user) => {
            db.batch_execute(&format!(
                "CREATE ROLE {user} LOGIN; GRANT CREATE ON DATABASE postgres TO {user}; GRANT ALL ON SCHEMA public TO {user};
                 GRANT ALL ON ALL TABLES IN SCHEMA public TO {user}; ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT ALL ON TABLES TO {user}"
            ))
            .unwrap();
            let (mut c, control, state, scratch) = proxy_cmd(srv, &pg, "behind-user");
            let args: Vec<String> =
                c.get_args().map(|a| a.to_string_lossy().replace("user=postgres", &format!("user={user}"))).collect();
            let mut c2 = Command::new(c.get_program());
            c2.args(args);
            for (k, v) in c.get_envs() {
                c2.env(k, v.unwrap());
            }
            c = c2;
            Proxied { mcp: Mcp::spawn(c), control, state, _scratch: scratch }
        }
    };
    let counted: bool = db
        .query_one("SELECT count(*) = 2 FROM pg_event_trigger WHERE evtname LIKE 'planarian_catalog%'", &[])
        .unwrap()
        .get(0);
    assert_eq!(counted, as_user.is_none(), "the event triggers exist only when the proxy could create them");
    let position = |p: &Proxied| control(&p.control, &["position"]).unwrap()["position"].as_u64().unwrap();
    // The proxy now keeps what the catalog says of items.
    let r = p.mcp.sql("UPDATE items SET name = name || '' WHERE id = 2");
    assert_ne!(r["isError"], json!(true), "{r}");
    let start = position(&p);
    // Behind the proxy: a new child of items, holding the row the next call deletes.
    db.batch_execute("CREATE TABLE new_items (note text, PRIMARY KEY (id)) INHERITS (items); INSERT INTO new_items VALUES (7, 'n7', 'kept')").unwrap();
    let before = dump_only(&mut db);
    let r = p.mcp.sql("DELETE FROM items WHERE id = 7");
    assert_ne!(r["isError"], json!(true), "{r}");
    // (with kept answers, its first form failed at its guard and took a position; the second,
    // from fresh answers, knows new_items; without, the answers were fresh the first time)
    let sent = if as_user.is_none() { 2 } else { 1 };
    assert_eq!(position(&p), start + sent, "how often the statement was sent");
    assert!(db.query("SELECT 1 FROM new_items", &[]).unwrap().is_empty());
    // Behind the proxy: a trigger on items. A write is refused, not rewritten from old answers.
    db.batch_execute("CREATE TRIGGER stamp_items BEFORE UPDATE ON items FOR EACH ROW EXECUTE FUNCTION keep()").unwrap();
    let r = p.mcp.sql("UPDATE items SET name = 'x' WHERE id = 2");
    let text = r["content"][0]["text"].as_str().unwrap_or_default();
    assert!(r["isError"] == json!(true) && text.contains("trigger stamp_items"), "{r}");
    db.batch_execute("DROP TRIGGER stamp_items ON items").unwrap();
    control(&p.control, &["compensate", &start.to_string()]).unwrap();
    assert_eq!(dump_only(&mut db), before, "the row is back in the child created behind the proxy, whole");
    drop(p);
}

#[test]
fn a_branch_is_a_copy_of_the_database_at_a_position_that_the_source_never_sees() {
    let (bin, servers) = require!();
    let Srv::Toolbox(tb) = &servers[0] else { unreachable!() };
    let pg = Pg::start(&bin, "branch");
    let mut db = pg.client();
    schema(&mut db);
    // The upstream names its database as {dbname}: each proxy's own.
    let proxy_on = |tag: &str, dbname: Option<&str>| {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().join(tag);
        std::fs::create_dir_all(&dir).unwrap();
        let (control, state) = (dir.join("control.sock"), dir.join("positions.json"));
        let mut c = Command::new(env!("CARGO_BIN_EXE_planarian-mcp-proxy"));
        c.args(["serve", "--server", "toolbox", "--database", &pg.dsn(), "--control"])
            .arg(&control)
            .arg("--state")
            .arg(&state);
        if let Some(d) = dbname {
            c.args(["--dbname", d]);
        }
        c.arg("--").arg(tb).args(["--prebuilt", "postgres", "--stdio", "--disable-version-check"]);
        c.env("POSTGRES_HOST", "127.0.0.1")
            .env("POSTGRES_PORT", pg.port.to_string())
            .env("POSTGRES_DATABASE", "{dbname}")
            .env("POSTGRES_USER", "postgres")
            .env("POSTGRES_PASSWORD", "unused")
            .stderr(Stdio::null());
        Proxied { mcp: Mcp::spawn(c), control, state, _scratch: scratch }
    };
    let mut src = proxy_on("branch-src", None);
    src.mcp.sql("INSERT INTO accounts VALUES (4, 'dee', 10, NULL, NULL)");
    src.mcp.sql("UPDATE accounts SET balance = 0 WHERE id = 1");
    let at = control(&src.control, &["position"]).unwrap()["position"].as_u64().unwrap();
    let at_dump = dump(&mut db);
    src.mcp.sql("DELETE FROM accounts WHERE id = 2");
    src.mcp.sql("CREATE TABLE later (id int PRIMARY KEY)");
    let src_dump = dump(&mut db);
    let b = control(&src.control, &["branch", &at.to_string(), "0123456789abcdef"]).unwrap();
    let name = b["database"].as_str().unwrap().to_string();
    assert_eq!(name, "postgres_0123456789ab");
    assert_eq!(dump(&mut db), src_dump, "the source is untouched");
    let mut bdb =
        Client::connect(&format!("{} dbname={name}", pg.dsn().replace("dbname=postgres", "")), NoTls).unwrap();
    assert_eq!(dump(&mut bdb), at_dump, "the branch is the database at the position");
    // The fork's proxy on its branch: its calls reach the branch only, and are undone there.
    let mut fork = proxy_on("branch-fork", Some(&name));
    assert_eq!(
        control(&fork.control, &["position"]).unwrap()["position"].as_u64(),
        Some(at),
        "positions go on from the branch point"
    );
    let r = fork.mcp.sql("INSERT INTO accounts VALUES (50, 'fork', 5, NULL, NULL)");
    assert_ne!(r["isError"], json!(true), "{r}");
    let r = fork.mcp.sql("SELECT owner FROM accounts WHERE id = 50");
    assert!(r["content"].to_string().contains("fork"), "the fork's server reads its branch: {r}");
    assert_eq!(dump(&mut db), src_dump, "the source never sees the fork's rows");
    control(&fork.control, &["compensate", &at.to_string()]).unwrap();
    assert_eq!(dump(&mut bdb), at_dump);
    // A position a rollback of the source undid cannot be branched from.
    control(&src.control, &["compensate", &(at - 1).to_string()]).unwrap();
    let err = control(&src.control, &["branch", &at.to_string(), "fedcba9876543210"]).unwrap_err();
    assert!(err.contains("can no longer be restored"), "{err}");
    let exists = |db: &mut Client, name: &str| -> bool {
        db.query_one("SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)", &[&name]).unwrap().get(0)
    };
    assert!(!exists(&mut db, "postgres_fedcba987654"), "a refused branch leaves no database");
    // A fork that failed after its branch was made: the branch is dropped (its sessions too).
    drop(fork);
    drop(bdb);
    let r = control(&src.control, &["unbranch", "0123456789abcdef"]).unwrap();
    assert_eq!(r["dropped"].as_str(), Some(name.as_str()));
    assert!(!exists(&mut db, &name));
    drop(src);
}

#[test]
fn undo_rows_an_older_proxy_wrote_are_still_undone() {
    let (bin, servers) = require!();
    let pg = Pg::start(&bin, "older");
    let mut db = pg.client();
    hierarchy(&mut db);
    let mut p = proxy(&servers[0], &pg, "older");
    let start = control(&p.control, &["position"]).unwrap()["position"].as_u64().unwrap();
    let before = dump_only(&mut db);
    for q in [
        "UPDATE measures SET v = v * 2",
        "DELETE FROM measures WHERE id = 2",
        "INSERT INTO measures VALUES (9, 'eu', 90)",
    ] {
        let r = p.mcp.sql(q);
        assert_ne!(r["isError"], json!(true), "{q}: {r}");
    }
    // As an older proxy wrote them: the table the statement named, not where each row lived.
    db.batch_execute("UPDATE planarian.undo SET rel = NULL").unwrap();
    control(&p.control, &["compensate", &start.to_string()]).unwrap();
    assert_eq!(dump_only(&mut db), before);
}

#[test]
fn a_compensation_whose_rows_land_elsewhere_fails_and_changes_nothing() {
    let (bin, servers) = require!();
    let pg = Pg::start(&bin, "verify");
    let mut db = pg.client();
    hierarchy(&mut db);
    let mut p = proxy(&servers[0], &pg, "verify");
    let start = control(&p.control, &["position"]).unwrap()["position"].as_u64().unwrap();
    let before = dump_only(&mut db);
    p.mcp.sql("DELETE FROM items WHERE id = 3");
    // Behind the proxy, a trigger now sends every row inserted into special_items to items: the
    // re-insert "succeeds", and the row would land in the wrong table.
    db.batch_execute(
        "CREATE FUNCTION divert() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN INSERT INTO items VALUES (NEW.id, NEW.name); RETURN NULL; END $$;
         CREATE TRIGGER divert BEFORE INSERT ON special_items FOR EACH ROW EXECUTE FUNCTION divert();",
    )
    .unwrap();
    let after = dump_only(&mut db);
    let err = control(&p.control, &["compensate", &start.to_string()]).unwrap_err();
    assert!(
        err.contains("did not restore what it promised") && err.contains("public.special_items with id=3"),
        "{err}"
    );
    assert_eq!(dump_only(&mut db), after, "a compensation that cannot keep its promise changes nothing");
    let undo: i64 = db.query_one("SELECT count(*) FROM planarian.undo", &[]).unwrap().get(0);
    assert_eq!(undo, 1, "the undo row stays for a later attempt");
    db.batch_execute("DROP TRIGGER divert ON special_items").unwrap();
    control(&p.control, &["compensate", &start.to_string()]).unwrap();
    assert_eq!(dump_only(&mut db), before);
    drop(p);
}

#[test]
fn a_row_changed_behind_the_proxy_is_a_conflict_and_nothing_is_clobbered() {
    let (bin, servers) = require!();
    let tb = &servers[0];
    let pg = Pg::start(&bin, "conflict");
    let mut db = pg.client();
    schema(&mut db);
    let mut p = proxy(tb, &pg, "conflict");
    let start = control(&p.control, &["position"]).unwrap()["position"].as_u64().unwrap();
    p.mcp.sql("INSERT INTO accounts VALUES (9, 'zed', 1, NULL, NULL)");
    p.mcp.sql("UPDATE accounts SET balance = 1000 WHERE id = 1");
    db.execute("UPDATE accounts SET balance = 999 WHERE id = 1", &[]).unwrap();
    let changed = dump(&mut db);
    let err = control(&p.control, &["compensate", &start.to_string()]).unwrap_err();
    assert!(err.contains("conflict") && err.contains("id=1"), "{err}");
    assert_eq!(dump(&mut db), changed, "a conflicting compensation changes nothing");
    let undo: i64 = db.query_one("SELECT count(*) FROM planarian.undo", &[]).unwrap().get(0);
    assert_eq!(undo, 2, "the undo rows stay for a later attempt");
    // Put the row back as the agent left it: the compensation then goes through.
    db.execute("UPDATE accounts SET balance = 1000 WHERE id = 1", &[]).unwrap();
    control(&p.control, &["compensate", &start.to_string()]).unwrap();
    let b: String = db.query_one("SELECT balance::text FROM accounts WHERE id = 1", &[]).unwrap().get(0);
    assert_eq!(b, "100");
    assert!(db.query("SELECT 1 FROM accounts WHERE id = 9", &[]).unwrap().is_empty());
    // A table the agent created, holding a row written behind the proxy: not dropped.
    let at = control(&p.control, &["position"]).unwrap()["position"].as_u64().unwrap();
    p.mcp.sql("CREATE TABLE scratch (id int PRIMARY KEY)");
    db.execute("INSERT INTO scratch VALUES (1)", &[]).unwrap();
    let err = control(&p.control, &["compensate", &at.to_string()]).unwrap_err();
    assert!(err.contains("conflict") && err.contains("scratch"), "{err}");
    assert_eq!(db.query("SELECT id FROM scratch", &[]).unwrap().len(), 1);
    db.execute("DELETE FROM scratch", &[]).unwrap();
    control(&p.control, &["compensate", &at.to_string()]).unwrap();
    let gone: bool = db.query_one("SELECT to_regclass('scratch') IS NULL", &[]).unwrap().get(0);
    assert!(gone);
    // A table the agent created filled (CREATE TABLE … AS): dropped only while it holds exactly
    // what the statement put there.
    p.mcp.sql("CREATE TABLE snapshot_of_accounts AS SELECT id, balance FROM accounts");
    db.execute("UPDATE snapshot_of_accounts SET balance = -1 WHERE id = 2", &[]).unwrap();
    let err = control(&p.control, &["compensate", &at.to_string()]).unwrap_err();
    assert!(err.contains("conflict") && err.contains("snapshot_of_accounts"), "{err}");
    db.execute("UPDATE snapshot_of_accounts SET balance = 50 WHERE id = 2", &[]).unwrap();
    control(&p.control, &["compensate", &at.to_string()]).unwrap();
    let gone: bool = db.query_one("SELECT to_regclass('snapshot_of_accounts') IS NULL", &[]).unwrap().get(0);
    assert!(gone);
    drop(p);
}

#[test]
fn the_undo_log_and_positions_survive_a_killed_proxy_and_a_restarted_upstream() {
    let (bin, servers) = require!();
    let tb = &servers[0];
    let pg = Pg::start(&bin, "crash");
    let mut db = pg.client();
    schema(&mut db);
    let before = dump(&mut db);
    let mut p = proxy(tb, &pg, "crash");
    let start = control(&p.control, &["position"]).unwrap()["position"].as_u64().unwrap();
    let balance = |db: &mut Client| -> String {
        db.query_one("SELECT balance::text FROM accounts WHERE id = 2", &[]).unwrap().get(0)
    };
    let was = balance(&mut db);
    // The call is sent, and the proxy killed once its change reached the database, before it can
    // answer or write anything more.
    p.mcp.send(&json!({"jsonrpc": "2.0", "id": "lost", "method": "tools/call",
        "params": {"name": "execute_sql", "arguments": {"sql": "UPDATE accounts SET balance = balance + 1 WHERE id = 2"}}}));
    wait_until(60, "the call did not reach the database within 60 s", || balance(&mut db) != was);
    p.mcp.child.kill().unwrap();
    p.mcp.child.wait().unwrap();
    // (its scratch directory kept for the next one)
    let Proxied { mcp, control: control_path, state, _scratch: scratch } = p;
    drop(mcp);
    assert!(state.exists());
    // A new proxy on the same state: the change that reached the database is undoable.
    let dir = control_path.parent().unwrap().to_path_buf();
    let _ = std::fs::remove_file(&control_path);
    let (c, control_path, state) = proxy_cmd_in(tb, &pg, &dir);
    let mut p2 = Proxied { mcp: Mcp::spawn(c), control: control_path, state, _scratch: scratch };
    assert_eq!(p2.control, dir.join("control.sock"));
    let pos = control(&p2.control, &["position"]).unwrap()["position"].as_u64().unwrap();
    assert!(pos > start, "the killed call's position is known after the restart: {pos}");
    // Upstream restarted under the proxy: kill the toolbox, the next call still works.
    let up = control(&p2.control, &["status"]).unwrap()["upstream-pid"].as_u64().unwrap();
    Command::new("kill").arg(up.to_string()).status().unwrap();
    // Until it is gone (a zombie until the proxy reaps it); the call below finds out.
    let gone = || {
        std::fs::read_to_string(format!("/proc/{up}/stat"))
            .map_or(true, |s| s.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'))
    };
    wait_until(60, "the upstream did not exit within 60 s of SIGTERM", gone);
    let mut r = p2.mcp.request(
        "tools/call",
        json!({"name": "execute_sql", "arguments": {"sql": "INSERT INTO accounts VALUES (8, 'x', 1, NULL, NULL)"}}),
    );
    if r.get("error").is_some() {
        // The call raced the restart: the proxy said so; a retry goes through.
        r = p2.mcp.request(
            "tools/call",
            json!({"name": "execute_sql", "arguments": {"sql": "INSERT INTO accounts VALUES (8, 'x', 1, NULL, NULL)"}}),
        );
    }
    assert!(r["result"].is_object() && r["result"]["isError"] != json!(true), "{r}");
    control(&p2.control, &["compensate", &start.to_string()]).unwrap();
    assert_eq!(dump(&mut db), before);
}

#[test]
fn concurrent_callers_are_serialised_and_every_write_is_undone() {
    let (bin, servers) = require!();
    let tb = &servers[0];
    let pg = Pg::start(&bin, "conc");
    let mut db = pg.client();
    schema(&mut db);
    let before = dump(&mut db);
    let mut p = proxy(tb, &pg, "conc");
    let start = control(&p.control, &["position"]).unwrap()["position"].as_u64().unwrap();
    // Many requests in flight at once on one stream, as a harness with parallel tool calls sends.
    for i in 0..20 {
        let sql = if i % 2 == 0 {
            format!("INSERT INTO accounts VALUES ({}, 'c{i}', {i}, NULL, NULL)", 100 + i)
        } else {
            "UPDATE accounts SET balance = balance + 1 WHERE id = 1".to_string()
        };
        p.mcp.send(&json!({"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": {"name": "execute_sql", "arguments": {"sql": sql}}}));
    }
    let mut seen = std::collections::HashSet::new();
    while seen.len() < 20 {
        let m = p.mcp.recv();
        assert!(m["result"].is_object() && m["result"]["isError"] != json!(true), "{m}");
        seen.insert(m["id"].as_u64().unwrap());
    }
    let b: String = db.query_one("SELECT balance::text FROM accounts WHERE id = 1", &[]).unwrap().get(0);
    assert_eq!(b, "110");
    assert_eq!(control(&p.control, &["position"]).unwrap()["position"].as_u64(), Some(start + 20));
    control(&p.control, &["compensate", &start.to_string()]).unwrap();
    assert_eq!(dump(&mut db), before);
}

/// A server started in a process group of its own (`process_group(0)`), stopped whole: Toolbox's command is a node
/// wrapper that runs the real server as its child, which a kill of the wrapper alone would leave
/// running (and listening on the port). Stopped when dropped too, so a failing test leaves none.
struct Group(Child, bool);

impl Group {
    fn of(child: Child) -> Group {
        Group(child, false)
    }

    fn stop(&mut self) {
        use nix::sys::signal::{killpg, Signal};
        // (once: a group reaped may have its number reused)
        if !std::mem::replace(&mut self.1, true) {
            let _ = killpg(nix::unistd::Pid::from_raw(self.0.id() as i32), Signal::SIGKILL);
        }
        let _ = self.0.wait();
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The real server as a Streamable HTTP server on a loopback port.
fn http_server(srv: &Srv, pg: &Pg, port: u16) -> Group {
    let mut c = match srv {
        Srv::Toolbox(tb) => {
            let mut h = Command::new(tb);
            h.args([
                "--prebuilt",
                "postgres",
                "--address",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--disable-version-check",
            ]);
            // The same connection settings as over stdio.
            for (k, v) in server_cmd(srv, pg).get_envs() {
                h.env(k, v.unwrap());
            }
            h
        }
        Srv::Dbhub(dh) => {
            let mut c = Command::new(dh);
            c.args(["--transport", "http", "--port", &port.to_string()])
                .args(["--dsn", &format!("postgres://postgres@127.0.0.1:{}/postgres?sslmode=disable", pg.port)]);
            c
        }
    };
    let server = Group::of(c.process_group(0).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap());
    wait_until(60, &format!("{srv:?} did not listen on {port} within 60 s"), || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    server
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// One raw HTTP request: (status, headers and body as text).
fn raw_http(url: &str, method: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
    use std::io::Read;
    let rest = url.strip_prefix("http://").unwrap();
    let (authority, path) = rest.split_at(rest.find('/').unwrap());
    let mut s = std::net::TcpStream::connect(authority).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req += &format!("{k}: {v}\r\n");
    }
    write!(s, "{req}\r\n{body}").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    (out.split(' ').nth(1).unwrap().parse().unwrap(), out)
}

#[test]
fn streamable_http_on_both_sides_with_the_official_sdk_client() {
    let (bin, servers) = require!();
    let sdk = root().join("target/npm/node_modules/@modelcontextprotocol/sdk");
    if !sdk.exists() {
        eprintln!("SKIPPED streamable_http: needs the MCP TypeScript SDK ({}); tests/run installs it", sdk.display());
        return;
    }
    for srv in &servers {
        eprintln!("--- {srv:?} over Streamable HTTP");
        let kind = if matches!(srv, Srv::Dbhub(_)) { "dbhub" } else { "toolbox" };
        let pg = Pg::start(&bin, &format!("http-{kind}"));
        let mut db = pg.client();
        schema(&mut db);
        let before = dump(&mut db);
        let port = free_port();
        let mut upstream = http_server(srv, &pg, port);
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().join(kind);
        std::fs::create_dir_all(&dir).unwrap();
        let control_path = dir.join("control.sock");
        let _ = std::fs::remove_file(&control_path);
        let mut proxy = Group::of(
            Command::new(env!("CARGO_BIN_EXE_planarian-mcp-proxy"))
                .args(["serve", "--server", kind, "--database", &pg.dsn(), "--http", "127.0.0.1:0", "--control"])
                .arg(&control_path)
                .arg("--state")
                .arg(dir.join("positions.json"))
                .args(["--upstream-url", &format!("http://127.0.0.1:{port}/mcp")])
                .stderr(Stdio::piped())
                .process_group(0)
                .spawn()
                .unwrap(),
        );
        let mut err = BufReader::new(proxy.0.stderr.take().unwrap());
        let url = loop {
            let mut l = String::new();
            assert!(err.read_line(&mut l).unwrap() > 0, "the proxy exited");
            if let Some(u) = l.trim().split("(Streamable HTTP) at ").nth(1) {
                break u.to_string();
            }
        };
        std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::stderr()));
        // The transport's rules, checked on the raw wire.
        let list = r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#;
        let json_hdr = [("Content-Type", "application/json"), ("Accept", "application/json, text/event-stream")];
        assert_eq!(raw_http(&url, "POST", &json_hdr, list).0, 400, "no session");
        assert_eq!(
            raw_http(&url, "POST", &[json_hdr[0], json_hdr[1], ("Mcp-Session-Id", "nope")], list).0,
            404,
            "unknown session"
        );
        let init = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-03-26","capabilities":{},"clientInfo":{"name":"raw","version":"1"}}}"#;
        assert_eq!(raw_http(&url, "POST", &[json_hdr[0], json_hdr[1], ("Origin", "http://evil.example")], init).0, 403);
        assert_eq!(raw_http(&url, "PUT", &json_hdr, init).0, 405);

        let start = control(&control_path, &["position"]).unwrap()["position"].as_u64().unwrap();
        let mut client = Command::new("node")
            .arg(root().join("hooks/tests/sdk-client.mjs"))
            .arg(&url)
            .arg(&sdk)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut to = client.stdin.take().unwrap();
        let mut from = BufReader::new(client.stdout.take().unwrap());
        let mut next = || {
            let mut l = String::new();
            assert!(from.read_line(&mut l).unwrap() > 0, "the SDK client exited");
            serde_json::from_str::<Value>(&l).unwrap()
        };
        let hello = next();
        assert!(hello["tools"].as_array().unwrap().contains(&json!("execute_sql")), "{hello}");
        let session = hello["session"].as_str().expect("the proxy gave the SDK a session").to_string();
        let mut call = |sql: &str| {
            writeln!(to, "{sql}").unwrap();
            to.flush().unwrap();
            let r = next();
            assert!(r.get("error").is_none(), "{sql}: {r}");
            r["result"].clone()
        };
        for sql in
            ["INSERT INTO accounts VALUES (4, 'dee', 10, NULL, NULL)", "UPDATE accounts SET balance = 1 WHERE id = 1"]
        {
            let r = call(sql);
            assert_ne!(r["isError"], json!(true), "{sql}: {r}");
        }
        let r = call("SELECT owner FROM accounts WHERE id = 4");
        assert!(r.to_string().contains("dee"), "{r}");
        assert_eq!(control(&control_path, &["position"]).unwrap()["position"].as_u64(), Some(start + 2));
        // The upstream restarts (its sessions are gone): the proxy opens a new one and the call
        // goes through.
        upstream.stop();
        wait_until(30, &format!("{srv:?} still listens on {port} after it was stopped"), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_err()
        });
        let upstream = http_server(srv, &pg, port);
        let r = call("DELETE FROM accounts WHERE id = 2");
        assert_ne!(r["isError"], json!(true), "after the upstream restarted: {r}");
        assert_eq!(db.query_one("SELECT count(*) FROM accounts WHERE id = 2", &[]).unwrap().get::<_, i64>(0), 0);
        let r = call("TRUNCATE accounts");
        assert_eq!(r["isError"], json!(true), "{r}");
        assert!(r.to_string().contains("planarian: not executed"), "{r}");
        assert_eq!(control(&control_path, &["position"]).unwrap()["position"].as_u64(), Some(start + 3));
        control(&control_path, &["compensate", &start.to_string()]).unwrap();
        assert_eq!(dump(&mut db), before, "every write made over HTTP is undone");
        // The SDK ends its session on close (DELETE): the session is gone.
        drop(to);
        assert!(client.wait().unwrap().success());
        let with = [json_hdr[0], json_hdr[1], ("Mcp-Session-Id", session.as_str())];
        assert_eq!(raw_http(&url, "POST", &with, list).0, 404, "the session ended");
        drop((proxy, upstream));
    }
}

/// hooks/tests/sdk-server.mjs on a loopback port.
fn sdk_server(modules: &Path, port: u16, pg: &Pg) -> Child {
    let child = Command::new("node")
        .arg(root().join("hooks/tests/sdk-server.mjs"))
        .arg(modules)
        .arg(port.to_string())
        .arg(format!("postgres://postgres@127.0.0.1:{}/postgres", pg.port))
        .spawn()
        .unwrap();
    wait_until(120, "the SDK server did not listen", || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
    child
}

/// A proxy in front of the SDK server, for a harness on stdio.
fn proxy_to_url(pg: &Pg, url: &str, tag: &str) -> (Mcp, PathBuf, tempfile::TempDir) {
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path().join(tag);
    std::fs::create_dir_all(&dir).unwrap();
    let control_path = dir.join("control.sock");
    let _ = std::fs::remove_file(&control_path);
    let mut c = Command::new(env!("CARGO_BIN_EXE_planarian-mcp-proxy"));
    c.args(["serve", "--database", &pg.dsn(), "--control"])
        .arg(&control_path)
        .arg("--state")
        .arg(dir.join("positions.json"))
        .args(["--upstream-url", url]);
    (Mcp::spawn(c), control_path, scratch)
}

/// Progress notifications come back through the proxy, and a cancellation reaches the server
/// under the id the proxy gave the request (the harness's own id means nothing there).
#[test]
fn progress_and_cancellation_pass_through() {
    let (bin, _) = require!();
    let modules = root().join("target/npm/node_modules");
    if !modules.join("@modelcontextprotocol/sdk").exists() {
        eprintln!("SKIPPED progress_and_cancellation: needs the MCP TypeScript SDK; tests/run installs it");
        return;
    }
    let pg = Pg::start(&bin, "cancel");
    let mut db = pg.client();
    let port = free_port();
    let mut upstream = sdk_server(&modules, port, &pg);
    let (mut mcp, _control, _scratch) = proxy_to_url(&pg, &format!("http://127.0.0.1:{port}/mcp"), "cancel");
    mcp.send(&json!({"jsonrpc": "2.0", "id": "slow", "method": "tools/call",
        "params": {"name": "sleep", "arguments": {"ms": 20000}, "_meta": {"progressToken": "tok-1"}}}));
    let p = mcp.recv();
    assert_eq!(p["method"], "notifications/progress", "{p}");
    assert_eq!(p["params"]["progressToken"], "tok-1", "{p}");
    mcp.send(&json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": "slow", "reason": "test"}}));
    wait_until(120, "the server never saw the cancellation", || {
        db.query_one("SELECT to_regclass('sleep_cancelled') IS NOT NULL", &[]).unwrap().get::<_, bool>(0)
    });
    // The session goes on.
    let r = mcp.request("tools/call", json!({"name": "sleep", "arguments": {"ms": 100}}));
    assert_eq!(r["result"]["content"][0]["text"], "slept", "{r}");
    drop(mcp);
    let _ = upstream.kill();
    let _ = upstream.wait();
}

/// The proxy is transparent to the protocol version: for each version a harness may ask for,
/// the Toolbox answers through the proxy exactly what it answers directly.
#[test]
fn every_protocol_version_gets_the_servers_own_answer() {
    let (bin, servers) = require!();
    let pg = Pg::start(&bin, "versions");
    schema(&mut pg.client());
    for version in ["2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"] {
        let init = json!({"protocolVersion": version, "capabilities": {}, "clientInfo": {"name": "planarian-test", "version": "1"}});
        let mut answers = Vec::new();
        for proxied in [false, true] {
            // (the proxy's scratch directory lives as long as the proxy)
            let (cmd, _scratch) = if proxied {
                let (c, _, _, scratch) = proxy_cmd(&servers[0], &pg, &format!("v{version}"));
                (c, Some(scratch))
            } else {
                (server_cmd(&servers[0], &pg), None)
            };
            let mut m = Mcp::start(cmd);
            let r = m.request("initialize", init.clone());
            m.send(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
            let q = m.sql("SELECT owner FROM accounts WHERE id = 1");
            assert!(q.to_string().contains("ann"), "{version}: {q}");
            answers.push(r["result"]["protocolVersion"].clone());
        }
        assert_eq!(answers[0], answers[1], "{version}");
        assert!(answers[0].is_string(), "{version}: {answers:?}");
    }
}

/// A server that keeps sessions (the SDK's own server transport) is restarted under the proxy:
/// the proxy's next call meets "session not found", opens a new session with the harness's
/// initialize parameters, and the call goes through; the harness notices nothing.
#[test]
fn a_lost_upstream_session_is_reestablished() {
    let (bin, _) = require!();
    let modules = root().join("target/npm/node_modules");
    if !modules.join("@modelcontextprotocol/sdk").exists() {
        eprintln!("SKIPPED a_lost_upstream_session: needs the MCP TypeScript SDK; tests/run installs it");
        return;
    }
    let pg = Pg::start(&bin, "session");
    let mut db = pg.client();
    schema(&mut db);
    let before = dump(&mut db);
    let port = free_port();
    let sdk_server = || sdk_server(&modules, port, &pg);
    let mut upstream = sdk_server();
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path().to_path_buf();
    let control_path = dir.join("control.sock");
    let _ = std::fs::remove_file(&control_path);
    let mut c = Command::new(env!("CARGO_BIN_EXE_planarian-mcp-proxy"));
    c.args(["serve", "--database", &pg.dsn(), "--control"])
        .arg(&control_path)
        .arg("--state")
        .arg(dir.join("positions.json"))
        .args(["--upstream-url", &format!("http://127.0.0.1:{port}/mcp")]);
    let mut mcp = Mcp::spawn(c);
    let start = control(&control_path, &["position"]).unwrap()["position"].as_u64().unwrap();
    // The server's log message during the call reaches the harness before the answer.
    mcp.send(&json!({"jsonrpc": "2.0", "id": "w1", "method": "tools/call",
        "params": {"name": "execute_sql", "arguments": {"sql": "INSERT INTO accounts VALUES (4, 'dee', 10, NULL, NULL)"}}}));
    let first = mcp.recv();
    assert_eq!(first["method"], "notifications/message", "{first}");
    // The answer, and the server's message outside the call (sent 100 ms after it, on the
    // standing GET stream): two streams, so in either order (a loaded machine relayed the answer
    // after it).
    let (a, b) = (mcp.recv(), mcp.recv());
    let (answer, after) = if a["id"] == "w1" { (a, b) } else { (b, a) };
    assert_eq!(answer["id"], "w1", "{answer}");
    assert_ne!(answer["result"]["isError"], json!(true), "{answer}");
    assert_eq!(after["params"]["data"], "after the call", "the server's message outside the call: {after}");
    upstream.kill().unwrap();
    upstream.wait().unwrap();
    let mut upstream = sdk_server();
    let r = mcp.sql("UPDATE accounts SET balance = 99 WHERE id = 1");
    assert_ne!(r["isError"], json!(true), "{r}");
    let b: String = db.query_one("SELECT balance::text FROM accounts WHERE id = 1", &[]).unwrap().get(0);
    assert_eq!(b, "99");
    assert_eq!(control(&control_path, &["position"]).unwrap()["position"].as_u64(), Some(start + 2));
    control(&control_path, &["compensate", &start.to_string()]).unwrap();
    assert_eq!(dump(&mut db), before);
    drop(mcp);
    let _ = upstream.kill();
    let _ = upstream.wait();
}

/// An upstream MCP server over Streamable HTTP that records the order in which messages reach it,
/// and whether one arrived while an earlier one was still unanswered. It is slow on purpose (it
/// answers each message 150 ms after reading it, and handles each connection on a thread of its
/// own, as real servers do), so that a proxy sending messages side by side is caught overlapping.
struct OrderRecorder {
    url: String,
    log: std::sync::Arc<std::sync::Mutex<Vec<(String, bool)>>>,
}

impl OrderRecorder {
    fn start() -> OrderRecorder {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::{Arc, Mutex};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/mcp", listener.local_addr().unwrap());
        let log: Arc<Mutex<Vec<(String, bool)>>> = Arc::default();
        let unanswered = Arc::new(AtomicUsize::new(0));
        let (log2, unanswered2) = (log.clone(), unanswered.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (log, unanswered) = (log2.clone(), unanswered2.clone());
                std::thread::spawn(move || {
                    let mut r = BufReader::new(conn.try_clone().unwrap());
                    let mut w = conn;
                    loop {
                        let mut line = String::new();
                        if r.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        let method = line.split(' ').next().unwrap_or("").to_string();
                        let mut len = 0;
                        loop {
                            let mut h = String::new();
                            r.read_line(&mut h).unwrap();
                            if h.trim().is_empty() {
                                break;
                            }
                            if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                                len = v.trim().parse().unwrap();
                            }
                        }
                        let mut body = vec![0; len];
                        std::io::Read::read_exact(&mut r, &mut body).unwrap();
                        if method != "POST" {
                            let status = if method == "GET" { "405 Method Not Allowed" } else { "200 OK" };
                            write!(w, "HTTP/1.1 {status}\r\nContent-Length: 0\r\n\r\n").unwrap();
                            continue;
                        }
                        let msg: Value = serde_json::from_slice(&body).unwrap();
                        let overlapped = unanswered.fetch_add(1, Ordering::SeqCst) > 0;
                        log.lock()
                            .unwrap()
                            .push((msg["method"].as_str().unwrap_or("response").to_string(), overlapped));
                        std::thread::sleep(std::time::Duration::from_millis(150));
                        let answer = match (msg["method"].as_str(), msg.get("id")) {
                            (Some("initialize"), Some(id)) => Some(json!({"jsonrpc": "2.0", "id": id, "result": {
                                "protocolVersion": "2025-06-18", "capabilities": {"tools": {}}, "serverInfo": {"name": "order-recorder", "version": "1"}}})),
                            (Some("tools/list"), Some(id)) => {
                                Some(json!({"jsonrpc": "2.0", "id": id, "result": {"tools": []}}))
                            }
                            (Some(_), Some(id)) => {
                                Some(json!({"jsonrpc": "2.0", "id": id, "result": {"content": [], "isError": false}}))
                            }
                            _ => None,
                        };
                        unanswered.fetch_sub(1, Ordering::SeqCst);
                        match answer {
                            Some(a) => {
                                let a = a.to_string();
                                write!(w, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nMcp-Session-Id: s1\r\nContent-Length: {}\r\n\r\n{a}", a.len()).unwrap();
                            }
                            None => write!(w, "HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\n\r\n").unwrap(),
                        }
                    }
                });
            }
        });
        OrderRecorder { url, log }
    }
}

#[test]
fn messages_to_an_http_upstream_arrive_in_order_one_after_another() {
    let (bin, _) = require!();
    let pg = Pg::start(&bin, "order");
    let up = OrderRecorder::start();
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path().to_path_buf();
    let mut c = Command::new(env!("CARGO_BIN_EXE_planarian-mcp-proxy"));
    // (a tool the server does not list, let through: this test is about the order of messages)
    c.args(["serve", "--database", &pg.dsn(), "--upstream-url", &up.url, "--pass", "anything", "--state"])
        .arg(dir.join("positions.json"));
    c.arg("--control").arg(dir.join("control.sock"));
    let mut m = Mcp::spawn(c);
    assert_eq!(m.request("tools/list", json!({}))["result"]["tools"], json!([]));
    // A call and, at once, its cancellation: the cancellation must not reach the server first.
    m.send(&json!({"jsonrpc": "2.0", "id": "slow", "method": "tools/call", "params": {"name": "anything", "arguments": {}}}));
    m.send(&json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": "slow"}}));
    loop {
        if m.recv()["id"] == "slow" {
            break;
        }
    }
    wait_until(60, "the cancellation to reach the upstream", || up.log.lock().unwrap().len() >= 5);
    let log = up.log.lock().unwrap().clone();
    let order: Vec<&str> = log.iter().map(|(m, _)| m.as_str()).collect();
    assert_eq!(
        order,
        ["initialize", "notifications/initialized", "tools/list", "tools/call", "notifications/cancelled"]
    );
    assert!(
        log.iter().all(|(_, overlapped)| !overlapped),
        "a message was sent before the previous one was answered: {log:?}"
    );
    drop(m);
}
