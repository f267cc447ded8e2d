//! Kubernetes through a real CRI engine: containerd 2.1's CRI plugin, planarian registered as a
//! runtime handler (the runc shim with `BinaryName`), driven over containerd's socket with the
//! calls a kubelet makes — `RunPodSandbox`, `PullImage`, `CreateContainer`, `StartContainer`,
//! `ExecSync`, `CheckpointContainer` (what the kubelet's `POST /checkpoint/…` calls) — and the
//! restore of that checkpoint into a new pod: `CreateContainer` whose image is the archive, then
//! `StartContainer`. The client is generated from the CRI protobuf (the `k8s-cri` crate). Images
//! come from a registry on the guest's loopback: containerd's restore pulls the checkpoint's
//! base image by its digest. Runs on the Debian 13 machine (containerd 2.1 is there).

use k8s_cri::v1 as cri;
use planarian_system_tests::sandbox::{State, WORKLOAD};
use planarian_system_tests::*;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The registry's address: loopback, so containerd (and Podman, told so) speak plain HTTP to it.
const REGISTRY: &str = "localhost:5055";
const HANDLER: &str = "planarian";

/// Why containerd's CRI cannot be tested here, if it cannot.
fn missing() -> Option<String> {
    let v = cmd("containerd", ["--version"]);
    if v.code != Some(0) {
        return Some("no containerd".into());
    }
    if !v.stdout.split_whitespace().any(|w| w.starts_with("v2.") || w.starts_with("2.")) {
        return Some(format!("containerd is not 2.x: {}", v.out()));
    }
    if cmd("docker-registry", ["--version"]).code != Some(0) {
        return Some("no docker-registry".into());
    }
    None
}

/// containerd, its registry and a CRI client; everything goes when it is dropped.
struct Engine {
    dir: PathBuf,
    containerd: Child,
    registry: Child,
    rt: tokio::runtime::Runtime,
    runtime: cri::runtime_service_client::RuntimeServiceClient<tonic::transport::Channel>,
    images: cri::image_service_client::ImageServiceClient<tonic::transport::Channel>,
    /// The handler's argv log: each call the runc shim made of planarian.
    argv: PathBuf,
    pods: Vec<String>,
}

impl Engine {
    fn start(dir: &Path) -> Engine {
        std::fs::create_dir_all(dir).unwrap();
        // The registry, filled by Podman with the test images (and a pause image made of one).
        std::fs::write(
            dir.join("registry.yml"),
            format!(
                "version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:5055\nlog:\n  level: warn\n",
                dir.join("registry").display()
            ),
        )
        .unwrap();
        let registry = Command::new("docker-registry")
            .arg("serve")
            .arg(dir.join("registry.yml"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("registry.log")).unwrap())
            .spawn()
            .expect("docker-registry");
        assert!(
            wait_for(Duration::from_secs(60), || std::net::TcpStream::connect("127.0.0.1:5055").is_ok()),
            "the registry did not listen"
        );
        std::fs::write(dir.join("Containerfile"), format!("FROM {BUSYBOX}\nCMD [\"sleep\", \"2147483647\"]\n"))
            .unwrap();
        podman(
            "planarian",
            &["build", "--pull=never", "-q", "-t", &format!("{REGISTRY}/planarian/pause:1"), dir.to_str().unwrap()],
        )
        .ok();
        for (from, to) in [(format!("{REGISTRY}/planarian/pause:1"), "pause:1"), (DEBIAN.to_string(), "debian:1")] {
            podman("planarian", &["push", "-q", "--tls-verify=false", &from, &format!("{REGISTRY}/planarian/{to}")])
                .ok();
        }

        // planarian as the runc shim runs it: through a wrapper that logs each argv (named
        // planarian, as the binary a handler names is).
        let argv = dir.join("argv.log");
        std::fs::create_dir_all(dir.join("handler")).unwrap();
        let handler = dir.join("handler/planarian");
        write_executable(
            &handler,
            &format!(
                "#!/bin/sh\nprintf '%s\\n' \"$*\" >> {}\nexec {} \"$@\"\n",
                argv.display(),
                planarian_bin().display()
            ),
        );
        let config = format!(
            r#"version = 3
root = "{d}/root"
state = "{d}/state"
[grpc]
  address = "{d}/containerd.sock"
[ttrpc]
  address = "{d}/containerd.sock.ttrpc"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{REGISTRY}/planarian/pause:1"
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.{HANDLER}]
  runtime_type = "io.containerd.runc.v2"
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.{HANDLER}.options]
    BinaryName = "{h}"
"#,
            d = dir.display(),
            h = handler.display()
        );
        std::fs::write(dir.join("config.toml"), config).unwrap();
        let containerd = Command::new("containerd")
            .arg("--config")
            .arg(dir.join("config.toml"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("containerd.log")).unwrap())
            .spawn()
            .expect("containerd");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let sock = dir.join("containerd.sock");
        assert!(wait_for(Duration::from_secs(120), || sock.exists()), "containerd did not start: {}", log(dir));
        let channel = rt
            .block_on(tonic::transport::Endpoint::from_static("http://[::]:50051").connect_with_connector(
                tower::service_fn(move |_: tonic::transport::Uri| {
                    let sock = sock.clone();
                    async move {
                        Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                            tokio::net::UnixStream::connect(sock).await?,
                        ))
                    }
                }),
            ))
            .expect("connect to containerd");
        let mut e = Engine {
            dir: dir.to_path_buf(),
            containerd,
            registry,
            rt,
            runtime: cri::runtime_service_client::RuntimeServiceClient::new(channel.clone()),
            images: cri::image_service_client::ImageServiceClient::new(channel),
            argv,
            pods: vec![],
        };
        // The CRI plugin answers once it is up.
        let mut version = None;
        assert!(
            wait_for(Duration::from_secs(120), || {
                let mut rs = e.runtime.clone();
                version = e.rt.block_on(rs.version(cri::VersionRequest::default())).ok();
                version.is_some()
            }),
            "containerd's CRI did not answer: {}",
            log(dir)
        );
        let v = version.unwrap().into_inner();
        println!("CRI: {} {} (API {})", v.runtime_name, v.runtime_version, v.runtime_api_version);
        e.pull(&format!("{REGISTRY}/planarian/pause:1"));
        e.pull(&format!("{REGISTRY}/planarian/debian:1"));
        e
    }

    fn pull(&mut self, image: &str) -> String {
        let req = cri::PullImageRequest {
            image: Some(cri::ImageSpec { image: image.into(), ..Default::default() }),
            ..Default::default()
        };
        let r = self.rt.block_on(self.images.pull_image(req));
        r.unwrap_or_else(|e| panic!("PullImage {image}: {e}\n{}", log(&self.dir))).into_inner().image_ref
    }

    /// A pod of the kubelet's kind on planarian's handler: the node's network (no CNI here),
    /// each container in a PID namespace of its own (as the kubelet asks by default).
    fn pod_config(&self, name: &str) -> cri::PodSandboxConfig {
        let logs = self.dir.join("pods").join(name);
        std::fs::create_dir_all(&logs).unwrap();
        cri::PodSandboxConfig {
            metadata: Some(cri::PodSandboxMetadata {
                name: name.into(),
                uid: format!("uid-{name}"),
                namespace: "default".into(),
                attempt: 0,
            }),
            // (none: a pod on the node's network shares its host name, as the kubelet's do)
            log_directory: logs.display().to_string(),
            linux: Some(cri::LinuxPodSandboxConfig {
                security_context: Some(cri::LinuxSandboxSecurityContext {
                    namespace_options: Some(namespaces()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn run_pod(&mut self, config: &cri::PodSandboxConfig) -> String {
        let req = cri::RunPodSandboxRequest { config: Some(config.clone()), runtime_handler: HANDLER.into() };
        let r = self.rt.block_on(self.runtime.run_pod_sandbox(req));
        let id = r.unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", self.diagnose())).into_inner().pod_sandbox_id;
        self.pods.push(id.clone());
        id
    }

    /// Creates and starts a container of `image` in `pod`; its ID.
    fn run(&mut self, pod: &str, pod_config: &cri::PodSandboxConfig, image: &str, command: Vec<String>) -> String {
        let config = cri::ContainerConfig {
            metadata: Some(cri::ContainerMetadata { name: "agent".into(), attempt: 0 }),
            image: Some(cri::ImageSpec { image: image.into(), ..Default::default() }),
            command,
            log_path: "agent.log".into(),
            linux: Some(cri::LinuxContainerConfig {
                security_context: Some(cri::LinuxContainerSecurityContext {
                    namespace_options: Some(namespaces()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let req = cri::CreateContainerRequest {
            pod_sandbox_id: pod.into(),
            config: Some(config),
            sandbox_config: Some(pod_config.clone()),
        };
        let r = self.rt.block_on(self.runtime.create_container(req));
        let id = r.unwrap_or_else(|e| panic!("CreateContainer ({image}): {e}\n{}", self.diagnose())).into_inner();
        let r = self.rt.block_on(
            self.runtime.start_container(cri::StartContainerRequest { container_id: id.container_id.clone() }),
        );
        r.unwrap_or_else(|e| panic!("StartContainer: {e}\n{}", self.diagnose()));
        id.container_id
    }

    /// `ExecSync`: (exit code, stdout).
    fn exec(&mut self, id: &str, script: &str) -> (i32, String) {
        let req = cri::ExecSyncRequest {
            container_id: id.into(),
            cmd: vec!["sh".into(), "-c".into(), script.into()],
            timeout: 60,
        };
        let r = self.rt.block_on(self.runtime.exec_sync(req));
        let r = r.unwrap_or_else(|e| panic!("ExecSync {script}: {e}\n{}", self.diagnose())).into_inner();
        (r.exit_code, String::from_utf8_lossy(&r.stdout).trim().to_string())
    }

    /// The workload's published state once it has answered command `seq`.
    fn state_at(&mut self, id: &str, seq: u64) -> State {
        let mut last = String::new();
        let answered = wait_for(Duration::from_secs(120), || {
            last = self.exec(id, "cat /tmp/state 2>/dev/null").1;
            last.split_whitespace().next().and_then(|s| s.parse::<u64>().ok()).is_some_and(|s| s >= seq)
        });
        assert!(answered, "no state {seq} from {id}: {last:?}\n{}", self.diagnose());
        let f: Vec<&str> = last.split_whitespace().collect();
        State { counter: f[1].parse().unwrap(), checksum: f[2].to_string() }
    }

    fn send(&mut self, id: &str, seq: u64, command: &str) -> State {
        let (code, _) = self.exec(id, &format!("echo '{seq} {command}' > /tmp/.cmd && mv /tmp/.cmd /tmp/cmd"));
        assert_eq!(code, 0);
        self.state_at(id, seq)
    }

    fn status(&mut self, id: &str) -> i32 {
        let req = cri::ContainerStatusRequest { container_id: id.into(), verbose: false };
        let r = self.rt.block_on(self.runtime.container_status(req)).expect("ContainerStatus").into_inner();
        r.status.map_or(-1, |s| s.state)
    }

    fn remove_pod(&mut self, pod: &str) {
        let stop =
            self.rt.block_on(self.runtime.stop_pod_sandbox(cri::StopPodSandboxRequest { pod_sandbox_id: pod.into() }));
        stop.unwrap_or_else(|e| panic!("StopPodSandbox: {e}\n{}", self.diagnose()));
        let rm = self
            .rt
            .block_on(self.runtime.remove_pod_sandbox(cri::RemovePodSandboxRequest { pod_sandbox_id: pod.into() }));
        rm.unwrap_or_else(|e| panic!("RemovePodSandbox: {e}\n{}", self.diagnose()));
        self.pods.retain(|p| p != pod);
    }

    /// What to read when a step fails: the argv planarian received, containerd's and its own log.
    fn diagnose(&self) -> String {
        let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_else(|e| format!("({}: {e})", p.display()));
        let own = read(Path::new("/var/log/planarian.log"));
        let tail: Vec<&str> = own.lines().rev().take(15).collect();
        format!("argv:\n{}\n{}\nplanarian.log (newest first):\n{}", read(&self.argv), log(&self.dir), tail.join("\n"))
    }
}

/// containerd's log, its last lines.
fn log(dir: &Path) -> String {
    let text = std::fs::read_to_string(dir.join("containerd.log")).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    format!("containerd.log (last lines):\n{}", lines[lines.len().saturating_sub(25)..].join("\n"))
}

fn namespaces() -> cri::NamespaceOption {
    cri::NamespaceOption {
        network: cri::NamespaceMode::Node as i32,
        pid: cri::NamespaceMode::Container as i32,
        ipc: cri::NamespaceMode::Pod as i32,
        ..Default::default()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        for pod in std::mem::take(&mut self.pods) {
            let mut rs = self.runtime.clone();
            let _ = self.rt.block_on(rs.stop_pod_sandbox(cri::StopPodSandboxRequest { pod_sandbox_id: pod.clone() }));
            let _ = self.rt.block_on(rs.remove_pod_sandbox(cri::RemovePodSandboxRequest { pod_sandbox_id: pod }));
        }
        for c in [&mut self.containerd, &mut self.registry] {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), nix::sys::signal::Signal::SIGTERM);
            let _ = c.wait();
        }
        // (what containerd left mounted under its root, deepest first)
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut ours: Vec<&str> = mounts
            .lines()
            .filter_map(|l| l.split_whitespace().nth(4))
            .filter(|m| m.starts_with(self.dir.to_str().unwrap()))
            .collect();
        ours.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in ours {
            let _ = cmd("umount", ["-l", m]);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn a_pods_container_checkpointed_through_containerds_cri_restores_exactly_in_a_new_pod() {
    require_stack!();
    if let Some(why) = missing() {
        if std::env::var_os("PLANARIAN_REQUIRE_SYSTEM").is_some() {
            panic!("containerd's CRI is required here but missing: {why}");
        }
        eprintln!("SKIPPED: {why} (tests/run runs this suite on the Debian 13 machine)");
        return;
    }
    let dir = PathBuf::from(format!("/var/tmp/planarian-cri-{}", std::process::id()));
    // Remote state: a hook that says where the sandbox's MCP calls are (position 42), so the
    // checkpoint records a position that must travel with it.
    std::fs::create_dir_all(&dir).unwrap();
    let hook = dir.join("remote-hook");
    let body = "#!/bin/sh\ncase $1 in capture) echo '{\"external-endpoint\": \"db://agents\", \"mcp-call-position\": 42}';; esac\n";
    write_executable(&hook, body);
    let _hooks = DropIn::new("zz-cri-remote-hook", &format!("[hooks]\nremote = [\"{}\"]\n", hook.display()));
    let mut e = Engine::start(&dir);

    // A pod on planarian's handler, its container the test workload (8 MiB of known memory).
    let pod_a = e.pod_config("agent-a");
    let a_pod = e.run_pod(&pod_a);
    let command = vec!["python3".into(), "-c".into(), WORKLOAD.into(), "8".into()];
    let a = e.run(&a_pod, &pod_a, &format!("{REGISTRY}/planarian/debian:1"), command);
    e.send(&a, 1, "tick");
    // A statepoint inside the node (the agent's own), then more changes: the checkpoint's
    // memory is an increment on it, and what travels must still restore whole.
    planarian(&["snapshot", &a, "--name", "inside"]).ok();
    let at = e.send(&a, 2, "dirty 65536 131072");
    assert_eq!(e.exec(&a, "mkdir -p /work && echo 'from pod a' > /work/notes").0, 0);

    // The kubelet's checkpoint: CheckpointContainer to an archive.
    let archive = dir.join("checkpoint-agent-a.tar");
    let req = cri::CheckpointContainerRequest {
        container_id: a.clone(),
        location: archive.display().to_string(),
        timeout: 0,
    };
    let r = e.rt.block_on(e.runtime.checkpoint_container(req));
    r.unwrap_or_else(|err| panic!("CheckpointContainer: {err}\n{}", e.diagnose()));
    // The source runs on after it.
    assert_eq!(e.status(&a), cri::ContainerState::ContainerRunning as i32);
    assert_eq!(e.send(&a, 3, "tick").counter, at.counter + 1);
    let listed = cmd("tar", ["-tf", archive.to_str().unwrap()]).ok().stdout.clone();
    println!(
        "CRI checkpoint archive: {} bytes, {} entries",
        std::fs::metadata(&archive).unwrap().len(),
        listed.lines().count()
    );
    for want in ["config.dump", "spec.dump", "status.dump", "rootfs-diff.tar", "checkpoint/inventory.img"] {
        assert!(listed.lines().any(|l| l.trim_start_matches("./") == want), "{want} not in the archive:\n{listed}");
    }
    // (planarian's part flat: containerd keeps only the checkpoint directory's top level)
    assert!(!listed.lines().any(|l| l.trim_end_matches('/').ends_with("checkpoint/planarian")), "{listed}");
    let handed = cmd("tar", ["-xOf", archive.to_str().unwrap(), "checkpoint/planarian%manifest.json"]);
    let handed: serde_json::Value =
        serde_json::from_str(&handed.ok().stdout.clone()).expect("planarian's manifest in the archive");
    assert_eq!(handed["remote-state"][0]["mcp-call-position"], 42, "{handed}");

    // As on another node: the source's pod and planarian's store of it are gone.
    e.remove_pod(&a_pod);
    let store = PathBuf::from("/var/lib/planarian/containers").join(&a);
    let _ = std::fs::remove_dir_all(&store);

    // The restore: a new pod, a container whose image is the checkpoint archive.
    let pod_b = e.pod_config("agent-b");
    let b_pod = e.run_pod(&pod_b);
    let b = e.run(&b_pod, &pod_b, archive.to_str().unwrap(), vec![]);
    assert_ne!(a, b);
    assert_eq!(e.status(&b), cri::ContainerState::ContainerRunning as i32);
    // Processes: memory and counter as at the checkpoint (the tick after it is not there).
    let now = e.state_at(&b, 2);
    assert_eq!((now.counter, &now.checksum), (at.counter, &at.checksum));
    let next = e.send(&b, 4, "tick");
    assert_eq!((next.counter, &next.checksum), (at.counter + 1, &at.checksum));
    // Files.
    assert_eq!(e.exec(&b, "cat /work/notes"), (0, "from pod a".to_string()));
    // The statepoint came with it, MCP position included, and starts b's chain.
    let list: serde_json::Value =
        serde_json::from_str(&planarian(&["statepoint", "list", &b, "--json"]).ok().stdout).unwrap();
    let sp = &list.as_array().expect("b's statepoints")[0];
    assert_eq!(sp["remote-state"], handed["remote-state"], "{sp}");
    assert!(sp["imported-from"].as_str().is_some_and(|f| f.starts_with(&a[..12])), "{sp}");
    // A statepoint of b, and back to it: planarian's own operations on a CRI container.
    planarian(&["snapshot", &b, "--name", "in-b"]).ok();
    e.send(&b, 5, "dirty 0 65536");
    let r = planarian(&["rollback", &b, "in-b", "--json"]);
    r.ok();
    let how: serde_json::Value = serde_json::from_str::<serde_json::Value>(&r.stdout).unwrap()["how"].clone();
    assert_eq!(how["path"], "in-place", "{how}");
    let back = e.state_at(&b, 4);
    assert_eq!((back.counter, &back.checksum), (at.counter + 1, &at.checksum));
    // What goes through Podman is refused in one line, changing nothing: a fork is a Podman
    // container cloned from its source.
    let fork = planarian(&["fork", &b, "in-b"]);
    assert_ne!(fork.code, Some(0));
    assert!(fork.stderr.contains("is run by a CRI engine (containerd), not by Podman"), "{}", fork.stderr);
    assert_eq!(e.status(&b), cri::ContainerState::ContainerRunning as i32);
    assert_eq!(e.state_at(&b, 4).checksum, at.checksum);

    let argv = std::fs::read_to_string(&e.argv).unwrap();
    let mut shown: Vec<&str> = argv.lines().collect();
    shown.dedup();
    println!("argv the runtime received (repeats folded):\n{}", shown.join("\n"));
    assert!(argv.lines().any(|l| l.contains(" create ") && l.contains("--bundle")), "{argv}");
    assert!(argv.lines().any(|l| l.contains(" checkpoint ") && l.contains("--leave-running")), "{argv}");
    assert!(argv.lines().any(|l| l.contains(" restore ") && l.contains("--image-path")), "{argv}");
    e.remove_pod(&b_pod);
}
