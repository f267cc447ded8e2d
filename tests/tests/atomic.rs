//! A rollback is atomic across the sandbox and its services: every step made to fail in turn,
//! on both paths, and planarian killed between the restored sandbox and the compensation.
//! (Apart from remote.rs, so that the two run side by side in the guests.)

use planarian_system_tests::sandbox::Ctr;
use planarian_system_tests::*;
use serde_json::{json, Value};
use std::path::Path;

mod mcp;
use mcp::*;

/// Every step of a rollback made to fail in turn (the fault points, and a real conflict in the
/// compensation: a row changed behind the proxy), on both paths (in place, and stop and
/// restore): a failure up to the compensation leaves the sandbox *and* the database both as
/// they were before; then the rollback succeeds and both are at the statepoint — or, planarian
/// killed between the restored sandbox and the compensation, the next operation finishes it.
/// On the stop-and-restore path compensation is the last step; in place it is the first
/// change, and a local step that fails after it takes the rollback forward: the statepoint
/// restored, sandbox and database both at it.
#[test]
fn a_failed_rollback_leaves_the_sandbox_and_the_database_together() {
    require_stack!();
    let Some((node, dbhub)) = node_and_dbhub() else { return };
    let pg = Pg::start();
    pg.psql("CREATE TABLE reports (id int PRIMARY KEY, body text NOT NULL)");
    // (one DBHub for both sandboxes, over Streamable HTTP: its start is a minute under emulation,
    // and a sidecar that starts its own server is remote.rs's)
    let server = DbhubHttp::start(&node, &dbhub, &pg);
    let _conf = DropIn::new(
        "zz-mcp-atomic",
        &format!(
            "[mcp.services.pltest-atomic]\nurl = \"{url}\"\nserver = \"dbhub\"\ndatabase = \"host=127.0.0.1 port={port} user=postgres dbname=postgres\"\n",
            url = server.url(),
            port = pg.port
        ),
    );
    const FAULT: &str = "/run/planarian/fault";
    struct Disarm;
    impl Drop for Disarm {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(FAULT);
        }
    }
    let _disarm = Disarm;
    let rows = || pg.psql("SELECT coalesce(string_agg(id || ':' || body, ',' ORDER BY id), '') FROM reports");
    // (stop and restore: its last local steps, before the compensation; in place: the
    // compensation itself, its first change. The other steps are in the matrices of faults.rs
    // and inplace.rs, which check the sandbox; in place, those after the compensation go
    // forward, below)
    for (in_place, points) in [
        (true, &["rollback.in-place.compensating"][..]),
        (false, &["rollback.files-restored", "rollback.restored"][..]),
    ] {
        pg.psql("DELETE FROM reports");
        let n = name(if in_place { "atomic-inplace" } else { "atomic-restore" });
        let _c = Cleanup(n.clone());
        let id = start_with_service(
            &n,
            "pltest-atomic",
            &[&format!("io.planarian.checkpoint.rollback_in_place={in_place}")],
        );
        let mut agent = Harness::connect(&id);
        let ok = |r: Value| assert_ne!(r["isError"], json!(true), "{r}");
        ok(agent.sql("INSERT INTO reports VALUES (1, 'at the statepoint')"));
        let ctr = Ctr::new(&n);
        ctr.sh("echo at-the-statepoint > /f").ok();
        let sp1 = planarian(&["snapshot", &n]).ok().out();
        let at_sp1 = rows();
        ok(agent.sql("UPDATE reports SET body = 'later' WHERE id = 1"));
        ok(agent.sql("INSERT INTO reports VALUES (2, 'later too')"));
        ctr.sh("echo later > /f").ok();
        let later = rows();
        // (what the sandbox holds, and that Podman sees it running, as an exec would have)
        let sandbox = || {
            assert_eq!(podman("planarian", &["inspect", "--format", "{{.State.Status}}", &n]).out(), "running");
            ctr.sh("cat /f").out()
        };
        for point in points {
            std::fs::write(FAULT, point).unwrap();
            let r = planarian(&["rollback", &n, &sp1]);
            assert!(r.code != Some(0) && r.stderr.contains(&format!("injected fault at {point}")), "{point}: {r:?}");
            assert!(r.stderr.contains("the container and its remote state are as they were before"), "{point}: {r:?}");
            assert!(!Path::new(FAULT).exists(), "{point}: the fault never fired");
            assert_eq!(sandbox(), "later", "{point}: the sandbox is as it was");
            assert_eq!(rows(), later, "{point}: the database is as it was");
        }
        if in_place {
            // Past the compensation: forward, to the statepoint, by a restore. (Every later step
            // goes forward the same way: inplace.rs fails each of them)
            let point = "rollback.in-place.memory";
            std::fs::write(FAULT, point).unwrap();
            let r = planarian(&["rollback", &n, &sp1, "--json"]);
            r.ok();
            assert!(!Path::new(FAULT).exists(), "{point}: the fault never fired");
            let ctx: Value = serde_json::from_str(&r.stdout).unwrap();
            assert_eq!(ctx["how"]["path"], "stop-and-restore", "{point}: {ctx}");
            assert!(ctx["how"]["not-in-place"].as_str().unwrap().contains(point), "{point}: {ctx}");
            assert_eq!(sandbox(), "at-the-statepoint", "{point}: the sandbox is at the statepoint");
            assert_eq!(rows(), at_sp1, "{point}: the database is at the statepoint");
            // (and later again)
            ok(agent.sql("UPDATE reports SET body = 'later' WHERE id = 1"));
            ok(agent.sql("INSERT INTO reports VALUES (2, 'later too')"));
            ctr.sh("echo later > /f").ok();
            assert_eq!(rows(), later);
        }
        // A real failure of the compensation: a row changed behind the proxy is a conflict.
        pg.psql("UPDATE reports SET body = 'by hand' WHERE id = 2");
        let by_hand = rows();
        let r = planarian(&["rollback", &n, &sp1]);
        assert!(
            r.code != Some(0) && r.stderr.contains("conflict") && r.stderr.contains("as they were before"),
            "{r:?}"
        );
        assert_eq!(sandbox(), "later", "after the conflict the sandbox is as it was");
        assert_eq!(rows(), by_hand, "after the conflict the database is as it was");
        pg.psql("UPDATE reports SET body = 'later too' WHERE id = 2");
        // planarian killed between the restored sandbox and the compensation (in place: just
        // before the compensation, the sandbox frozen and untouched): the database is not
        // compensated yet; the next operation finishes the compensation (and, in place, the
        // rollback: the statepoint restored), and then both are at the statepoint. On the
        // stop-and-restore path the sandbox runs meanwhile, and a call from it is refused.
        let point = if in_place { "rollback.in-place.compensating" } else { "rollback.restored" };
        std::fs::write(FAULT, format!("kill:{point}")).unwrap();
        let r = planarian(&["rollback", &n, &sp1]);
        assert!(r.code.is_none() || r.code == Some(137), "killed at {point}: {r:?}");
        assert!(!Path::new(FAULT).exists(), "{point}: the fault never fired");
        assert_eq!(rows(), later, "not compensated yet");
        if !in_place {
            assert_eq!(sandbox(), "at-the-statepoint");
            let refused = agent.sql("INSERT INTO reports VALUES (9, 'in between')");
            assert!(
                refused["isError"] == json!(true)
                    && refused["content"][0]["text"].as_str().unwrap().contains("interrupted"),
                "{refused}"
            );
        }
        let r = planarian(&["snapshot", &n]);
        r.ok();
        assert!(r.stderr.contains("finished the compensation of an interrupted rollback"), "{r:?}");
        assert_eq!(sandbox(), "at-the-statepoint");
        assert_eq!(rows(), at_sp1);
        if in_place {
            // Killed after the compensation, while memory is written (the held processes die
            // with planarian): the database is at the statepoint already; the next operation
            // restores the sandbox to it and finishes the compensation's intent.
            ok(agent.sql("UPDATE reports SET body = 'later' WHERE id = 1"));
            ok(agent.sql("INSERT INTO reports VALUES (2, 'later too')"));
            ctr.sh("echo later > /f").ok();
            assert_eq!(rows(), later);
            std::fs::write(FAULT, "kill:rollback.in-place.memory").unwrap();
            let r = planarian(&["rollback", &n, &sp1]);
            assert!(r.code.is_none() || r.code == Some(137), "killed at memory: {r:?}");
            assert!(!Path::new(FAULT).exists(), "memory: the fault never fired");
            assert_eq!(rows(), at_sp1, "compensated before the first write");
            let r = planarian(&["snapshot", &n]);
            r.ok();
            assert!(r.stderr.contains("finished the compensation of an interrupted rollback"), "{r:?}");
            assert_eq!(sandbox(), "at-the-statepoint");
            assert_eq!(rows(), at_sp1);
            // (the sandbox's processes died with planarian, and its MCP sidecar with them: the
            // agent connects again, to the sidecar the restore started)
            agent = Harness::connect(&id);
        }
        ok(agent.sql("INSERT INTO reports VALUES (3, 'after')"));
        drop(agent);
    }
}
