//! `e2e`: agent traces replayed end to end (paper §6.3).
//!
//! A trace is what an agent did in a sandbox: its tool calls (shell commands) with the model's
//! think time before each. Each trace is replayed on three systems, one after the other in the
//! same run:
//!
//! * **No-snapshot**: plain Podman (crun), no state management;
//! * **Planarian**: a statepoint after every tool call, asynchronous (`snapshot --async`: it runs
//!   while the model thinks; the next tool call waits for it if it has not ended), and one
//!   rollback at the end, to the statepoint halfway through;
//! * **Full-snapshot**: a full dump and a full copy of the files after every tool call
//!   (`full_dump_interval=1`), synchronous, and the same rollback at the end.
//!
//! The think times are replayed as sleeps (the model's latency is the trace's, not measured) and
//! can be scaled down (`--scales 1,0.5,0.25`) to show where the overlap stops hiding the cost —
//! or up, to native proportion (`--scales native`): under emulation every tool call and
//! statepoint is slower by a factor the think time is not, so the think times are stretched by
//! that factor, measured in the same run as the slowdown of reference commands timed here and
//! on the host (`planarian-bench calibrate`, which bench/run runs on the host first).
//!
//! The traces are modelled on Terminal-Bench's system-administration tasks: written for this
//! benchmark, each a sequence an agent would issue, with think times of 2–4 s (the per-step
//! latency of a hosted model answering a short tool-call turn). Every step must succeed (its exit
//! code is checked), so a system that broke the sandbox fails the benchmark instead of looking
//! fast. The database traces, modelled on Bird-interact's maintenance sessions (reads, updates,
//! a schema change, deletes), call DBHub's `execute_sql` over MCP: directly for No-snapshot,
//! through the sandbox's state proxy (the sidecar, which records every write's undo) for the
//! other two, against one PostgreSQL whose tables are made anew before each replay.

use super::{flag, run_quiet, PLANARIAN};
use planarian_contracts::jsonrpc;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

struct Trace {
    name: &'static str,
    what: &'static str,
    /// Tables (with rows) the trace starts from, for database traces: SQL run before it.
    setup: Option<&'static str>,
    /// (think ms before the call, the call)
    steps: &'static [(u64, Call)],
}

#[derive(Clone, Copy)]
enum Call {
    /// A shell command in the sandbox (`podman exec … sh -c`).
    Sh(&'static str),
    /// A SQL statement through the MCP server's `execute_sql` tool.
    Sql(&'static str),
}
use Call::{Sh, Sql};

const TRACES: &[Trace] = &[
    Trace {
        name: "service",
        setup: None,
        what: "install a small HTTP service into the rootfs, configure it, start it in the background, reconfigure and restart it",
        steps: &[
            (3000, Sh("mkdir -p /opt/svc && printf '%s\\n' 'import http.server, sys' 'g = dict(l.strip().split(\"=\", 1) for l in open(\"/etc/svc.conf\") if \"=\" in l)' 'class H(http.server.BaseHTTPRequestHandler):' '    def do_GET(self):' '        self.send_response(200); self.end_headers(); self.wfile.write(g[\"greeting\"].encode())' 'http.server.HTTPServer((\"127.0.0.1\", int(g[\"port\"])), H).serve_forever()' > /opt/svc/server.py")),
            (2500, Sh("printf 'port=8080\\ngreeting=hello\\n' > /etc/svc.conf && cat /etc/svc.conf")),
            (3500, Sh("(python3 /opt/svc/server.py >/var/log/svc.log 2>&1 & echo $! > /run/svc.pid) && for i in $(seq 200); do python3 -c 'import urllib.request; print(urllib.request.urlopen(\"http://127.0.0.1:8080\").read().decode())' 2>/dev/null && exit 0; sleep 0.1; done; exit 1")),
            (3000, Sh("sed -i s/hello/bonjour/ /etc/svc.conf && kill $(cat /run/svc.pid) && (python3 /opt/svc/server.py >/var/log/svc.log 2>&1 & echo $! > /run/svc.pid)")),
            (2500, Sh("for i in $(seq 200); do python3 -c 'import urllib.request; print(urllib.request.urlopen(\"http://127.0.0.1:8080\").read().decode())' 2>/dev/null | grep -q bonjour && exit 0; sleep 0.1; done; exit 1")),
        ],
    },
    Trace {
        name: "configs",
        setup: None,
        what: "generate an application's configuration files, edit them with sed, validate them",
        steps: &[
            (2500, Sh("mkdir -p /etc/app && for i in $(seq 40); do printf '{\"name\": \"svc%s\", \"debug\": false, \"workers\": 2}\\n' $i > /etc/app/svc$i.json; done && ls /etc/app | wc -l")),
            (3000, Sh("grep -l '\"debug\": false' /etc/app/*.json | wc -l")),
            (2000, Sh("sed -i 's/\"workers\": 2/\"workers\": 8/' /etc/app/svc1*.json && grep -c '\"workers\": 8' /etc/app/svc1.json")),
            (3500, Sh("python3 -c 'import json, glob; print(sum(json.load(open(f))[\"workers\"] for f in glob.glob(\"/etc/app/*.json\")))'")),
        ],
    },
    Trace {
        name: "build",
        setup: None,
        what: "write a small Python project, byte-compile it, run its tests, fix a failing one",
        steps: &[
            (3000, Sh("mkdir -p /work/calc/calc /work/calc/tests && cd /work/calc && printf 'def add(a, b):\\n    return a + b\\n\\ndef mul(a, b):\\n    return a + b\\n' > calc/__init__.py && touch tests/__init__.py")),
            (3500, Sh("cd /work/calc && printf 'import unittest\\nfrom calc import add, mul\\nclass T(unittest.TestCase):\\n    def test_add(self):\\n        self.assertEqual(add(2, 3), 5)\\n    def test_mul(self):\\n        self.assertEqual(mul(2, 3), 6)\\n' > tests/test_calc.py && python3 -m compileall -q calc tests")),
            (2500, Sh("cd /work/calc && python3 -m unittest -q 2>&1 | tail -1; true")),
            (4000, Sh("cd /work/calc && sed -i '5s/a + b/a * b/' calc/__init__.py && python3 -m unittest -q")),
        ],
    },
    Trace {
        name: "fix-setup",
        setup: None,
        what: "a broken startup script: run it, read the error, fix the path it names, run it again",
        steps: &[
            (2000, Sh("mkdir -p /srv/app && printf '#!/bin/sh\\nset -e\\n. /srv/app/env.sh\\necho \"started $APP_NAME\" > /srv/app/status\\n' > /srv/app/start.sh && chmod +x /srv/app/start.sh")),
            (3000, Sh("/srv/app/start.sh 2>&1; true")),
            (3500, Sh("printf 'APP_NAME=demo\\n' > /srv/app/env.sh && /srv/app/start.sh && cat /srv/app/status")),
            (2000, Sh("grep -q 'started demo' /srv/app/status")),
        ],
    },
    Trace {
        name: "logs",
        setup: None,
        what: "generate a service's logs, rotate and compress them, count the errors",
        steps: &[
            (2500, Sh("mkdir -p /var/log/app && python3 -c 'import random\nrandom.seed(1)\nwith open(\"/var/log/app/app.log\", \"w\") as f:\n    for i in range(60000): f.write(\"%d %s request %d\\n\" % (i, random.choice([\"INFO\", \"INFO\", \"WARN\", \"ERROR\"]), i))' && wc -l /var/log/app/app.log")),
            (3000, Sh("cd /var/log/app && mv app.log app.log.1 && gzip app.log.1 && : > app.log && ls -la")),
            (2500, Sh("zcat /var/log/app/app.log.1.gz | grep -c ERROR")),
            (3000, Sh("zcat /var/log/app/app.log.1.gz | awk '{print $2}' | sort | uniq -c")),
        ],
    },
    Trace {
        name: "data",
        setup: None,
        what: "produce a CSV, sort and aggregate it, keep a summary",
        steps: &[
            (3000, Sh("mkdir -p /data && python3 -c 'import random\nrandom.seed(2)\nwith open(\"/data/sales.csv\", \"w\") as f:\n    for i in range(40000): f.write(\"%s,%d\\n\" % (random.choice([\"north\", \"south\", \"east\", \"west\"]), random.randint(1, 100)))' && wc -l /data/sales.csv")),
            (2500, Sh("sort -t, -k1,1 /data/sales.csv > /data/sorted.csv && head -2 /data/sorted.csv")),
            (3500, Sh("awk -F, '{s[$1]+=$2} END {for (k in s) print k, s[k]}' /data/sales.csv | sort > /data/summary.txt && cat /data/summary.txt")),
            (2000, Sh("test $(wc -l < /data/summary.txt) = 4")),
        ],
    },
    Trace {
        name: "db-inventory",
        setup: Some(
            "CREATE TABLE products (id int PRIMARY KEY, name text NOT NULL, stock int NOT NULL);
             INSERT INTO products SELECT i, 'item ' || i, (i * 37) % 100 FROM generate_series(1, 400) i;",
        ),
        what: "database maintenance: find low stock, restock it, record a report in the sandbox, add a product",
        steps: &[
            (3000, Sql("SELECT count(*) AS low FROM products WHERE stock < 10")),
            (3500, Sql("UPDATE products SET stock = stock + 50 WHERE stock < 10")),
            (2500, Sh("mkdir -p /reports && echo 'restocked products below 10' > /reports/inventory.txt")),
            (3000, Sql("SELECT sum(stock) AS total FROM products")),
            (2500, Sql("INSERT INTO products (id, name, stock) VALUES (1001, 'widget', 5)")),
        ],
    },
    Trace {
        name: "db-schema",
        setup: Some(
            "CREATE TABLE customers (id int PRIMARY KEY, name text NOT NULL, spend int NOT NULL);
             INSERT INTO customers SELECT i, 'customer ' || i, (i * 53) % 1000 FROM generate_series(1, 500) i;",
        ),
        what: "a schema change: add a column, backfill it, index it, read by it",
        steps: &[
            (3500, Sql("ALTER TABLE customers ADD COLUMN IF NOT EXISTS tier text DEFAULT 'basic'")),
            (3000, Sql("UPDATE customers SET tier = 'gold' WHERE spend > 900")),
            (2500, Sql("CREATE INDEX customers_tier ON customers (tier)")),
            (3000, Sql("SELECT tier, count(*) FROM customers GROUP BY tier ORDER BY tier")),
        ],
    },
    Trace {
        name: "db-cleanup",
        setup: Some(
            "CREATE TABLE events (id int PRIMARY KEY, kind text NOT NULL, age_days int NOT NULL);
             INSERT INTO events SELECT i, CASE WHEN i % 3 = 0 THEN 'old' ELSE 'click' END, i % 60 FROM generate_series(1, 600) i;",
        ),
        what: "a cleanup session: count stale rows, delete them, relabel others, read the result",
        steps: &[
            (2500, Sql("SELECT count(*) FROM events WHERE age_days > 45")),
            (3500, Sql("DELETE FROM events WHERE age_days > 45")),
            (3000, Sql("UPDATE events SET kind = 'archived' WHERE kind = 'old'")),
            (2500, Sql("SELECT kind, count(*) FROM events GROUP BY kind ORDER BY kind")),
        ],
    },
];

#[derive(Clone, Copy, PartialEq)]
enum System {
    NoSnapshot,
    Planarian,
    Full,
}

impl System {
    fn label(self) -> &'static str {
        match self {
            System::NoSnapshot => "No-snapshot",
            System::Planarian => "Planarian",
            System::Full => "Full-snapshot",
        }
    }
}

#[derive(Default, Clone, Copy)]
struct Run {
    /// From the first think to the last call (and the closing rollback).
    total: Duration,
    think: Duration,
    /// The snapshots' own work, from their manifests (for Planarian: mostly hidden in think time).
    snapshot_work: Duration,
    rollback: Duration,
    /// Rollbacks, and those that took the in-place path.
    rollbacks: u32,
    in_place: u32,
}

fn replay(trace: &Trace, system: System, scale: f64, db: Option<&Db>) -> Result<Run, String> {
    let ctr = format!("plbench-e2e-{}-{}", trace.name, std::process::id());
    let mut run = vec![
        "--runtime",
        if system == System::NoSnapshot { "crun" } else { "planarian" },
        "run",
        "-d",
        "--name",
        &ctr,
        "--network",
        "none",
    ];
    if system == System::Full {
        run.extend(["--annotation", "io.planarian.checkpoint.full_dump_interval=1"]);
    }
    if trace.setup.is_some() && system != System::NoSnapshot {
        // The sandbox's MCP service: its sidecar (the state proxy) in front of DBHub.
        run.extend(["--annotation", "io.planarian.mcp.service=plbench"]);
    }
    run.extend(["localhost/planarian-test/debian", "sleep", "100000"]);
    let result = (|| -> Result<Run, String> {
        let db = match (trace.setup, db) {
            (Some(setup), Some(db)) => {
                db.psql(&format!("DROP SCHEMA IF EXISTS planarian CASCADE; DROP TABLE IF EXISTS products, customers, events CASCADE; {setup}"))?;
                Some(db)
            }
            (Some(_), None) => return Err("a database trace without a database".into()),
            _ => None,
        };
        run_quiet("podman", &run)?;
        // The agent's MCP session, opened before the clock starts (DBHub takes seconds to load
        // under emulation): DBHub itself without state management, else the sandbox's sidecar.
        let mut mcp = match db {
            Some(db) if system == System::NoSnapshot => {
                Some(Mcp::start(Command::new(&db.node).arg(&db.dbhub).args([
                    "--transport",
                    "stdio",
                    "--dsn",
                    &db.dsn(),
                ]))?)
            }
            Some(_) => {
                let id = run_quiet("podman", &["inspect", "--format", "{{.Id}}", &ctr])?;
                Some(Mcp::start(Command::new(PROXY).args(["connect", &id]))?)
            }
            None => None,
        };
        let mut r = Run::default();
        let mut statepoints = Vec::new();
        let start = Instant::now();
        for (i, (think_ms, call)) in trace.steps.iter().enumerate() {
            let think = Duration::from_secs_f64(*think_ms as f64 * scale / 1e3);
            std::thread::sleep(think); // the model thinking (the trace's latency, replayed)
            r.think += think;
            match call {
                Sh(c) => run_quiet("podman", &["exec", &ctr, "sh", "-c", c]).map(drop),
                Sql(q) => mcp.as_mut().ok_or("a SQL call in a trace without a database")?.sql(q),
            }
            .map_err(|e| format!("step {}: {e}", i + 1))?;
            if system != System::NoSnapshot {
                let args: &[&str] =
                    if system == System::Planarian { &["snapshot", &ctr, "--async"] } else { &["snapshot", &ctr] };
                statepoints.push(run_quiet(PLANARIAN, args)?);
            }
        }
        if system != System::NoSnapshot {
            let last = statepoints.last().unwrap();
            run_quiet(PLANARIAN, &["statepoint", "wait", &ctr, last])?;
            let target = &statepoints[(statepoints.len() - 1) / 2];
            let t = Instant::now();
            let ctx = run_quiet(PLANARIAN, &["rollback", &ctr, target, "--json"])?;
            r.rollback = t.elapsed();
            let ctx: serde_json::Value = serde_json::from_str(&ctx).map_err(|e| format!("rollback --json: {e}"))?;
            r.rollbacks = 1;
            if ctx["how"]["path"] == "in-place" {
                r.in_place = 1;
            } else {
                eprintln!(
                    "planarian-bench e2e: {}: the rollback was not in place: {}",
                    trace.name, ctx["how"]["not-in-place"]
                );
            }
        }
        r.total = start.elapsed();
        for sp in &statepoints {
            let m = super::manifest(&ctr, sp)?;
            r.snapshot_work += Duration::from_secs_f64(m["measurements"]["total-ms"].as_f64().unwrap_or(0.0) / 1e3);
        }
        Ok(r)
    })();
    if let Ok(id) = run_quiet("podman", &["inspect", "--format", "{{.Id}}", &ctr]) {
        let _ = run_quiet("podman", &["rm", "-f", "-t", "0", &ctr]);
        let _ = std::fs::remove_dir_all(std::path::Path::new("/var/lib/planarian/containers").join(id));
    }
    result
}

const PROXY: &str = "/usr/local/bin/planarian-mcp-proxy";

/// The database of the database traces: a PostgreSQL for the run, and the MCP service a sandbox
/// names (`[mcp.services.plbench]`: DBHub under node, over stdio).
struct Db {
    dir: PathBuf,
    port: u16,
    node: PathBuf,
    dbhub: PathBuf,
    dropin: PathBuf,
}

impl Db {
    fn start() -> Result<Db, String> {
        let dbhub = std::env::current_dir()
            .map_err(|e| e.to_string())?
            .join("target/npm/node_modules/@bytebase/dbhub/dist/index.js");
        let node = ["/usr/bin/node", "/usr/local/bin/node"].into_iter().map(PathBuf::from).find(|p| p.exists());
        let Some(node) = node.filter(|_| dbhub.exists()) else {
            return Err(format!("node or DBHub missing ({}): tests/run installs them (its npm step)", dbhub.display()));
        };
        let dir = PathBuf::from(format!("/tmp/plbench-pg-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        run_quiet("chown", &["postgres:postgres", dir.to_str().unwrap()])?;
        let port =
            std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_err(|e| e.to_string())?.port();
        let d = dir.display();
        run_quiet(
            "runuser",
            &[
                "-u",
                "postgres",
                "--",
                &format!("{}/initdb", crate::pg_bin()),
                "-D",
                &format!("{d}/data"),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
            ],
        )?;
        let opts = format!("-k {d} -c listen_addresses=127.0.0.1 -p {port} -c fsync=off");
        run_quiet(
            "runuser",
            &[
                "-u",
                "postgres",
                "--",
                &format!("{}/pg_ctl", crate::pg_bin()),
                "-D",
                &format!("{d}/data"),
                "-w",
                "-l",
                &format!("{d}/log"),
                "-o",
                &opts,
                "start",
            ],
        )?;
        let dropin = PathBuf::from("/etc/planarian/planarian.conf.d/zz-plbench-e2e.conf");
        let db = Db { dir, port, node, dbhub, dropin };
        let service = format!(
            "[mcp.services.plbench]\nupstream = [\"{}\", \"{}\", \"--transport\", \"stdio\", \"--dsn\", \"{}\"]\nserver = \"dbhub\"\ndatabase = \"host=127.0.0.1 port={port} user=postgres dbname=postgres\"\n",
            db.node.display(),
            db.dbhub.display(),
            db.dsn()
        );
        std::fs::create_dir_all(db.dropin.parent().unwrap()).map_err(|e| e.to_string())?;
        std::fs::write(&db.dropin, service).map_err(|e| format!("{}: {e}", db.dropin.display()))?;
        Ok(db)
    }

    fn dsn(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres?sslmode=disable", self.port)
    }

    fn psql(&self, sql: &str) -> Result<String, String> {
        run_quiet(
            "psql",
            &[
                "-X",
                "-q",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
                "-c",
                sql,
            ],
        )
    }
}

impl Drop for Db {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.dropin);
        let d = self.dir.display();
        let _ = run_quiet(
            "runuser",
            &[
                "-u",
                "postgres",
                "--",
                &format!("{}/pg_ctl", crate::pg_bin()),
                "-D",
                &format!("{d}/data"),
                "-m",
                "immediate",
                "stop",
            ],
        );
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// An MCP client session over stdio: the agent's side of its database tool.
struct Mcp {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    next: u64,
}

impl Mcp {
    fn start(command: &mut Command) -> Result<Mcp, String> {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("{command:?}: {e}"))?;
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut m = Mcp { child, stdin, lines, next: 0 };
        m.request("initialize", json!({"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "planarian-bench", "version": "1"}}))?;
        writeln!(m.stdin, "{}", jsonrpc::notification("notifications/initialized", Value::Null))
            .map_err(|e| e.to_string())?;
        Ok(m)
    }

    fn request(&mut self, method: &str, params: Value) -> Result<Value, String> {
        self.next += 1;
        writeln!(self.stdin, "{}", jsonrpc::request(self.next, method, params)).map_err(|e| e.to_string())?;
        self.stdin.flush().map_err(|e| e.to_string())?;
        loop {
            // Generous: the first request waits for the server to load under emulation.
            let line = self
                .lines
                .recv_timeout(Duration::from_secs(600))
                .map_err(|e| format!("no answer to {method} within 600 s: {e}"))?;
            let v: Value = serde_json::from_str(&line).map_err(|e| format!("{e}: {line}"))?;
            if v["id"] == json!(self.next) {
                return match v.get("error") {
                    Some(e) => Err(format!("{method}: {e}")),
                    None => Ok(v["result"].clone()),
                };
            }
        }
    }

    fn sql(&mut self, sql: &str) -> Result<(), String> {
        let r = self.request("tools/call", json!({"name": "execute_sql", "arguments": {"sql": sql}}))?;
        if r["isError"] == json!(true) {
            return Err(format!("{sql}: {r}"));
        }
        Ok(())
    }
}

impl Drop for Mcp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One line of the table: a trace (or all of them) on the three systems.
fn row(name: &str, calls: usize, runs: &[Run]) -> String {
    let s = |d: Duration| d.as_secs_f64();
    let (n, p, f) = (&runs[0], &runs[1], &runs[2]);
    format!(
        "| {name} | {calls} | {:.1} | {:.1} | {:.1} | {:.1} | {:+.1} % | {:+.1} % | {:.2}x | {:.1} / {:.1} | {:.1} / {:.1} |",
        s(n.think), s(n.total), s(p.total), s(f.total),
        (s(p.total) / s(n.total) - 1.0) * 100.0, (s(f.total) / s(n.total) - 1.0) * 100.0, s(f.total) / s(p.total),
        s(p.snapshot_work), s(f.snapshot_work), s(p.rollback), s(f.rollback)
    )
}

/// Reference commands for the emulator's slowdown: process start-ups, a shell loop, Python's
/// start-up and a little of its work — what a tool call and a statepoint are made of.
const REFERENCE: &[(&str, &[&str])] = &[
    ("50 × /bin/true", &["sh", "-c", "for i in $(seq 50); do /bin/true; done"]),
    ("a shell loop", &["sh", "-c", "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done"]),
    (
        "python3 start-up and work",
        &[
            "python3",
            "-c",
            "import json, hashlib; hashlib.sha256(json.dumps(list(range(200000))).encode()).hexdigest()",
        ],
    ),
];

/// Each reference command's time (ms), the best of five.
pub fn reference_ms() -> Result<Vec<f64>, String> {
    REFERENCE
        .iter()
        .map(|(what, argv)| {
            (0..5)
                .map(|_| {
                    let t = Instant::now();
                    let ok = Command::new(argv[0]).args(&argv[1..]).status().map_err(|e| format!("{what}: {e}"))?;
                    ok.success().then(|| t.elapsed().as_secs_f64() * 1e3).ok_or(format!("{what} failed"))
                })
                .try_fold(f64::MAX, |best, t| Ok::<f64, String>(best.min(t?)))
        })
        .collect()
}

/// `planarian-bench calibrate`: the reference commands' times here, a comma-separated line
/// (what bench/run measures on the host and hands to the guest).
pub fn calibrate() -> i32 {
    match reference_ms() {
        Ok(v) => {
            println!("{}", v.iter().map(|t| format!("{t:.2}")).collect::<Vec<_>>().join(","));
            0
        }
        Err(e) => {
            eprintln!("planarian-bench calibrate: {e}");
            1
        }
    }
}

/// The emulator's slowdown: the geometric mean, over the reference commands, of their time here
/// against the host's (`PLANARIAN_BENCH_HOST_REFERENCE`, from `calibrate` on the host), with
/// what it is made of.
fn native_factor() -> Result<(f64, String), String> {
    let host: Vec<f64> = std::env::var("PLANARIAN_BENCH_HOST_REFERENCE")
        .map_err(|_| {
            "think times in native proportion need the host's reference times (bench/run measures them)".to_string()
        })?
        .split(',')
        .filter_map(|t| t.parse().ok())
        .collect();
    let here = reference_ms()?;
    if host.len() != here.len() {
        return Err(format!("{} host reference times for {} commands", host.len(), here.len()));
    }
    let ratios: Vec<f64> = here.iter().zip(&host).map(|(g, h)| g / h).collect();
    let factor = ratios.iter().map(|r| r.ln()).sum::<f64>() / ratios.len() as f64;
    let parts = REFERENCE
        .iter()
        .zip(here.iter().zip(&host))
        .map(|((what, _), (g, h))| format!("{what}: {g:.0} ms here, {h:.0} ms on the host"))
        .collect::<Vec<_>>()
        .join("; ");
    Ok((factor.exp(), parts))
}

pub fn main(args: &[String]) -> i32 {
    let mut scales: Vec<f64> = Vec::new();
    // How the native scale was measured, said again above its table.
    let mut native: Option<(f64, String)> = None;
    for s in flag(args, "--scales").unwrap_or("1,0.5,0.25").split(',') {
        if s == "native" {
            // The emulator slows every tool call and statepoint by this factor, not the model:
            // the think times are stretched by as much, so that they weigh what they weigh natively.
            match native_factor() {
                Ok((f, parts)) => {
                    let f = (f * 10.0).round() / 10.0;
                    eprintln!("e2e: native proportion: think times x{f}, the geometric mean of the reference commands' slowdown here ({parts})");
                    scales.push(f);
                    native = Some((f, parts));
                }
                Err(e) => {
                    eprintln!("planarian-bench e2e: {e}");
                    return 2;
                }
            }
        } else if let Ok(x) = s.parse() {
            scales.push(x);
        }
    }
    let only: Option<Vec<&str>> = flag(args, "--traces").map(|t| t.split(',').collect());
    let traces: Vec<&Trace> = TRACES.iter().filter(|t| only.as_ref().is_none_or(|o| o.contains(&t.name))).collect();
    if scales.is_empty() || traces.is_empty() {
        eprintln!(
            "planarian-bench e2e: nothing to run (--scales 1,0.5 --traces {})",
            TRACES.iter().map(|t| t.name).collect::<Vec<_>>().join(",")
        );
        return 2;
    }
    let db = if traces.iter().any(|t| t.setup.is_some()) {
        match Db::start() {
            Ok(db) => Some(db),
            Err(e) => {
                eprintln!("planarian-bench e2e: {e}");
                return 1;
            }
        }
    } else {
        None
    };
    let systems = [System::NoSnapshot, System::Planarian, System::Full];
    let s = |d: Duration| d.as_secs_f64();
    let mut overall = Vec::new();
    for &scale in &scales {
        let mut rows = Vec::new();
        for t in &traces {
            let mut runs = Vec::new();
            for &sys in &systems {
                eprintln!("e2e: {} on {} (think x{scale}) ...", t.name, sys.label());
                match replay(t, sys, scale, db.as_ref()) {
                    Ok(r) => runs.push(r),
                    Err(e) => {
                        eprintln!("planarian-bench e2e: {} on {}: {e}", t.name, sys.label());
                        return 1;
                    }
                }
            }
            rows.push((t, runs));
        }
        println!("\nend to end, think times x{scale} (all times s; overhead = against No-snapshot)");
        if let Some((_, parts)) = native.as_ref().filter(|(f, _)| *f == scale) {
            println!("(native proportion: x{scale} is the emulator's slowdown here, the geometric mean over reference commands: {parts})");
        }
        println!("| trace | calls | think | No-snapshot | Planarian | Full-snapshot | Planarian overhead | Full overhead | Full / Planarian | snapshot work pl / full | rollback pl / full |");
        println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        let mut sum = [Run::default(); 3];
        for (t, runs) in &rows {
            println!("{}", row(t.name, t.steps.len(), runs));
            for (total, r) in sum.iter_mut().zip(runs) {
                total.total += r.total;
                total.think += r.think;
                total.snapshot_work += r.snapshot_work;
                total.rollback += r.rollback;
                total.rollbacks += r.rollbacks;
                total.in_place += r.in_place;
            }
        }
        println!(
            "rollbacks in place: Planarian {} of {}, Full-snapshot {} of {} (the reasons of the others above)",
            sum[1].in_place, sum[1].rollbacks, sum[2].in_place, sum[2].rollbacks
        );
        println!("{}", row("**all**", rows.iter().map(|(t, _)| t.steps.len()).sum(), &sum));
        overall.push((scale, sum));
    }
    if overall.len() > 1 {
        println!("\nall traces, by think time (overhead against No-snapshot)");
        println!(
            "| think times | No-snapshot s | Planarian s | Full-snapshot s | Planarian overhead | Full overhead |"
        );
        println!("|---|---:|---:|---:|---:|---:|");
        for (scale, sum) in &overall {
            let (n, p, f) = (s(sum[0].total), s(sum[1].total), s(sum[2].total));
            println!(
                "| x{scale} | {n:.1} | {p:.1} | {f:.1} | {:+.1} % | {:+.1} % |",
                (p / n - 1.0) * 100.0,
                (f / n - 1.0) * 100.0
            );
        }
    }
    println!(
        "\n(each trace's calls are checked: a failing step fails the benchmark; the traces: {})",
        traces.iter().map(|t| format!("{}: {}", t.name, t.what)).collect::<Vec<_>>().join("; ")
    );
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_gives_times_overheads_and_ratios() {
        let r = |total: f64, work: f64, rollback: f64| Run {
            total: Duration::from_secs_f64(total),
            think: Duration::from_secs(10),
            snapshot_work: Duration::from_secs_f64(work),
            rollback: Duration::from_secs_f64(rollback),
            ..Run::default()
        };
        assert_eq!(
            row("configs", 4, &[r(20.0, 0.0, 0.0), r(25.0, 4.0, 5.0), r(30.0, 6.0, 5.5)]),
            "| configs | 4 | 10.0 | 20.0 | 25.0 | 30.0 | +25.0 % | +50.0 % | 1.20x | 4.0 / 6.0 | 5.0 / 5.5 |"
        );
    }
}
