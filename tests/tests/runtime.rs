//! `podman --runtime planarian` behaves like `podman --runtime crun`: every pass-through verb,
//! through the real Podman and conmon. Each scenario runs through both runtimes and compares.

use planarian_system_tests::*;
use std::time::Duration;

const RUNTIMES: [&str; 2] = ["crun", "planarian"];

#[test]
fn run_rm_gives_the_same_output_and_exit_codes() {
    require_stack!();
    // (podman run flags, command, expected exit code)
    let cases: &[(&[&str], &[&str], Option<i32>)] = &[
        // (one container for both streams and an exit code of its own: a container costs
        // seconds under emulation, and every other test's `run --rm … true` exits 0)
        (&[], &["sh", "-c", "echo to-stdout; echo to-stderr >&2; exit 7"], Some(7)),
        // Death by signal of the container's main process (under an init, since PID 1 of a PID
        // namespace cannot be killed from inside it): Podman reports 128 + signal.
        (&["--init"], &["sh", "-c", "kill -9 $$"], Some(137)),
        (&[], &["/no/such/binary"], Some(127)),
    ];
    for (flags, argv, want) in cases {
        let mut results = Vec::new();
        for rt in RUNTIMES {
            // (no network: Podman's bridge costs seconds a container under emulation, and the
            // bridge has its own test below)
            let mut args = vec!["run", "--rm", "--network", "none"];
            args.extend_from_slice(flags);
            args.push(BUSYBOX);
            args.extend_from_slice(argv);
            let r = podman(rt, &args);
            assert_eq!(r.code, *want, "{rt} {flags:?} {argv:?}: {r:?}");
            results.push(r);
        }
        assert_eq!(results[0].stdout, results[1].stdout, "{argv:?}");
        if *want != Some(127) {
            assert_eq!(results[0].stderr, results[1].stderr, "{argv:?}");
        } else {
            // Podman's message for a missing binary names the runtime; the cause must be there.
            assert!(results[1].stderr.contains("/no/such/binary"), "{:?}", results[1]);
        }
    }
}

#[test]
fn detached_container_lifecycle_exec_logs_top_stop_rm() {
    require_stack!();
    let mut seen = Vec::new();
    for rt in RUNTIMES {
        let n = name("life");
        let _c = Cleanup(n.clone());
        podman(
            rt,
            &[
                "run",
                "-d",
                "--name",
                &n,
                BUSYBOX,
                "sh",
                "-c",
                // (no process comes and goes while `podman top` reads /proc: a loop of short
                // sleeps made it fail now and then, "read /proc/N/cmdline: no such process")
                "echo started; trap 'echo bye; exit 0' TERM; sleep 100000 & wait",
            ],
        )
        .ok();
        assert!(wait_for(Duration::from_secs(120), || podman(rt, &["logs", &n]).stdout.contains("started")));
        let exec = podman(rt, &["exec", &n, "sh", "-c", "echo in-$((40+2)); cat /proc/1/cmdline | tr '\\0' ' '"]);
        exec.ok();
        let exec_fail = podman(rt, &["exec", &n, "sh", "-c", "exit 3"]);
        assert_eq!(exec_fail.code, Some(3), "{rt}: {exec_fail:?}");
        let top = podman(rt, &["top", &n, "pid", "args"]);
        top.ok();
        assert!(top.stdout.contains("sleep 100000 & wait"), "{rt} top: {}", top.stdout);
        let state = podman(rt, &["inspect", "--format", "{{.State.Status}} {{.OCIRuntime}}", &n]).out();
        assert_eq!(state, format!("running {rt}"));
        podman(rt, &["stop", "-t", "10", &n]).ok();
        let logs = podman(rt, &["logs", &n]).stdout;
        assert_eq!(logs, "started\nbye\n", "{rt}");
        let exited = podman(rt, &["inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", &n]).out();
        assert_eq!(exited, "exited 0", "{rt}");
        podman(rt, &["rm", &n]).ok();
        assert_ne!(podman(rt, &["inspect", &n]).code, Some(0), "{rt}: container still there after rm");
        seen.push((exec.stdout, top.stdout.lines().count()));
    }
    assert_eq!(seen[0], seen[1]);
}

/// What a rollback and a fork find of container `n` without asking Podman (containers/storage,
/// crun's record, its conmon) is what `podman inspect` says, by name and by ID prefix.
fn podman_free_lookup_agrees(n: &str, status: &str) {
    let podman = engine::runtime::podman::inspect(n).unwrap();
    assert_eq!(podman.status, status);
    for key in [n.to_string(), podman.id[..12].to_string()] {
        let found =
            engine::statepoint::planarian_container(&engine::Engine::load(Default::default()).unwrap(), &key).unwrap();
        let fields = |c: &engine::runtime::podman::PodmanContainer| {
            (c.id.clone(), c.name.clone(), c.status.clone(), c.runtime.clone(), c.bundle.clone(), c.upperdir.clone())
        };
        assert_eq!(fields(&found), fields(&podman), "{key}");
        assert!(podman.upperdir.as_ref().is_some_and(|u| u.is_dir()), "{podman:?}");
    }
}

#[test]
fn pause_and_unpause() {
    require_stack!();
    for rt in RUNTIMES {
        let n = name("pause");
        let _c = Cleanup(n.clone());
        // A counter the test can read from outside through the log.
        podman(
            rt,
            &[
                "run",
                "--network",
                "none",
                "-d",
                "--name",
                &n,
                BUSYBOX,
                "sh",
                "-c",
                "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 1; done",
            ],
        )
        .ok();
        if rt == "planarian" {
            podman_free_lookup_agrees(&n, "running");
        }
        // (counting already: on a slow machine the first count comes seconds after the start)
        let count = || podman(rt, &["exec", &n, "cat", "/tmp/count"]).out().parse::<u64>().ok();
        assert!(wait_for(Duration::from_secs(120), || count().is_some()), "{rt}: the counter never started");
        podman(rt, &["pause", &n]).ok();
        assert_eq!(podman(rt, &["inspect", "--format", "{{.State.Status}}", &n]).out(), "paused", "{rt}");
        if rt == "planarian" {
            // Frozen: only Podman knows whether it is paused; asked.
            podman_free_lookup_agrees(&n, "paused");
        }
        let a = podman(rt, &["inspect", "--format", "{{.State.Paused}}", &n]).out();
        assert_eq!(a, "true");
        podman(rt, &["unpause", &n]).ok();
        assert_eq!(podman(rt, &["inspect", "--format", "{{.State.Status}}", &n]).out(), "running", "{rt}");
        let c1 = count().expect("counted before the pause");
        assert!(
            wait_for(Duration::from_secs(120), || count().unwrap_or(0) > c1),
            "{rt}: the counter did not advance after unpause"
        );
    }
}

#[test]
fn kill_with_a_signal_reaches_the_container() {
    require_stack!();
    for rt in RUNTIMES {
        let n = name("kill");
        let _c = Cleanup(n.clone());
        podman(
            rt,
            &[
                "run",
                "--network",
                "none",
                "-d",
                "--name",
                &n,
                BUSYBOX,
                "sh",
                "-c",
                "trap 'echo got-usr1' USR1; echo ready; while :; do sleep 1; done",
            ],
        )
        .ok();
        assert!(wait_for(Duration::from_secs(120), || podman(rt, &["logs", &n]).stdout.contains("ready")));
        podman(rt, &["kill", "-s", "USR1", &n]).ok();
        assert!(wait_for(Duration::from_secs(120), || podman(rt, &["logs", &n]).stdout.contains("got-usr1")), "{rt}");
        podman(rt, &["kill", "-s", "KILL", &n]).ok();
        assert!(
            wait_for(Duration::from_secs(120), || {
                podman(rt, &["inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", &n]).out() == "exited 137"
            }),
            "{rt}"
        );
    }
}

#[test]
fn interactive_tty_container() {
    require_stack!();
    let mut outputs = Vec::new();
    for rt in RUNTIMES {
        let (out, code) = run_on_pty(
            "podman",
            &["--runtime", rt, "run", "-it", "--rm", "--network", "none", BUSYBOX, "sh"],
            "# ",
            "tty; echo tty-ok-$((6*7)); stty size; exit 5\r",
            Duration::from_secs(60),
        );
        assert_eq!(code, Some(5), "{rt}: {out}");
        assert!(out.contains("/dev/pts/0"), "{rt}: {out}");
        assert!(out.contains("tty-ok-42"), "{rt}: {out}");
        // The typed line may be echoed once or twice depending on when the shell reads it; the
        // command's own output appears exactly once under either runtime.
        outputs.push(out.lines().filter(|l| l.contains("tty-ok-42")).count());
    }
    assert_eq!(outputs, vec![1, 1]);
}

#[test]
fn network_none_and_default_bridge() {
    require_stack!();
    for rt in RUNTIMES {
        let none =
            podman(rt, &["run", "--rm", "--network", "none", BUSYBOX, "sh", "-c", "echo $(ls /sys/class/net | sort)"]);
        none.ok();
        assert_eq!(none.out(), "lo", "{rt}");
        let bridge = podman(rt, &["run", "--rm", BUSYBOX, "sh", "-c", "echo $(ls /sys/class/net | sort); ip -4 addr show eth0 | grep -o 'inet [0-9.]*'; ip route | grep -c default"]);
        bridge.ok();
        let lines: Vec<&str> = bridge.stdout.lines().collect();
        assert_eq!(lines[0].trim(), "eth0 lo", "{rt}: {bridge:?}");
        assert!(lines[1].starts_with("inet 10.88."), "{rt}: {bridge:?}");
        assert_eq!(lines[2], "1", "{rt}: {bridge:?}");
    }
}

#[test]
fn inspect_and_info_name_the_runtime() {
    require_stack!();
    let n = name("inspect");
    let _c = Cleanup(n.clone());
    podman("planarian", &["create", "--name", &n, BUSYBOX, "true"]).ok();
    assert_eq!(podman("crun", &["inspect", "--format", "{{.OCIRuntime}}", &n]).out(), "planarian");
    let info = podman(
        "planarian",
        &["info", "--format", "{{.Host.OCIRuntime.Name}}|{{.Host.OCIRuntime.Path}}|{{.Host.OCIRuntime.Version}}"],
    );
    info.ok();
    let out = info.out();
    let mut parts = out.splitn(3, '|');
    assert_eq!(parts.next(), Some("planarian"));
    assert_eq!(parts.next(), Some("/usr/local/bin/planarian"));
    let version = parts.next().unwrap();
    assert!(version.starts_with("planarian version "), "{version}");
    assert!(version.contains("crun version"), "{version}");
    // A later command looks the runtime up again by name: start the created container.
    podman("crun", &["start", "--attach", &n]).ok();
}

#[test]
fn podman_sees_checkpoint_support() {
    require_stack!();
    // Podman's probe: `checkpoint --help` must exit 0 for checkpoint/restore to be supported.
    let probe = cmd(planarian_bin().to_str().unwrap(), ["checkpoint", "--help"]);
    assert_eq!(probe.code, Some(0), "{probe:?}");
    assert!(probe.stdout.contains("--leave-running"), "{probe:?}");
}

#[test]
fn annotations_override_settings_per_container() {
    require_stack!();
    let n = name("annot");
    let _c = Cleanup(n.clone());
    podman(
        "planarian",
        &[
            "run",
            "--network",
            "none",
            "-d",
            "--name",
            &n,
            "--annotation",
            "io.planarian.checkpoint.full_dump_interval=3",
            BUSYBOX,
            "sleep",
            "600",
        ],
    )
    .ok();
    let id = podman("planarian", &["inspect", "--format", "{{.Id}}", &n]).out();
    let r = cmd(planarian_bin().to_str().unwrap(), ["config", &id]);
    r.ok();
    assert!(r.stdout.contains("full_dump_interval = 3"), "{r:?}");
    // Other containers keep the configured value.
    let plain = cmd(planarian_bin().to_str().unwrap(), ["config"]);
    assert!(plain.stdout.contains("full_dump_interval = 8"), "{plain:?}");

    let bad = name("annot-bad");
    let _b = Cleanup(bad.clone());
    podman(
        "planarian",
        &[
            "run",
            "--network",
            "none",
            "-d",
            "--name",
            &bad,
            "--annotation",
            "io.planarian.runtime.crun_path=/tmp/x",
            BUSYBOX,
            "sleep",
            "600",
        ],
    )
    .ok();
    let id = podman("planarian", &["inspect", "--format", "{{.Id}}", &bad]).out();
    let r = cmd(planarian_bin().to_str().unwrap(), ["config", &id]);
    assert_eq!(r.code, Some(1));
    assert!(r.stderr.contains("not a per-container setting"), "{r:?}");
    let unknown = cmd(planarian_bin().to_str().unwrap(), ["config", "pltest-no-such-container"]);
    assert_eq!(unknown.code, Some(1));
    assert!(unknown.stderr.contains("unknown container"), "{unknown:?}");
}
