//! What a sandbox can reach of planarian: nothing. Its statepoints (the store, with every
//! sandbox's memory images), the sidecars' control and client sockets and their HTTP endpoints
//! are the host's; a process in a sandbox — on no network or on Podman's bridge — finds none of
//! them, and cannot connect to a sidecar's endpoint (which listens on the host's loopback only).

use planarian_system_tests::sandbox::*;
use planarian_system_tests::*;

#[test]
fn a_sandbox_reaches_no_statepoint_no_sidecar_socket_and_no_endpoint() {
    require_stack!();
    let a = Sandbox::start("isolated", 4, &[]);
    let b = Sandbox::start("isolated-bridge", 4, &["--network", "podman"]);
    let sp = a.snapshot("private");
    let id = a.id();
    let store = format!("/var/lib/planarian/containers/{id}/statepoints/{sp}");
    assert!(std::path::Path::new(&store).is_dir(), "the statepoint is on the host: {store}");
    // What the host has, the sandboxes do not see.
    let mcp = planarian_contracts::paths::mcp_dir().display().to_string();
    std::fs::create_dir_all(&mcp).unwrap();
    for sb in [&a, &b] {
        for path in ["/var/lib/planarian", "/run/planarian", &store, &mcp] {
            let r = sb.exec(&format!("test -e '{path}'"));
            assert_eq!(r.code, Some(1), "{}: {path} is visible inside: {r:?}", sb.name);
        }
        let socks = sb.exec("find / -xdev -type s 2>/dev/null").out();
        assert!(socks.is_empty(), "{}: sockets inside: {socks}", sb.name);
    }
    // An endpoint on the host's loopback, as a sidecar's is: the host reaches it, the sandbox
    // on the bridge does not (through the gateway or the name Podman gives the host).
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok(), "the host reaches its own endpoint");
    let gateway = b.exec("ip route 2>/dev/null | awk '/default/ {print $3}'; true").out();
    let gateway =
        if gateway.is_empty() { b.exec("awk '$2 == \"00000000\" {print $3}' /proc/net/route").out() } else { gateway };
    let gateway = if gateway.len() == 8 && !gateway.contains('.') {
        // /proc/net/route: little-endian hex.
        let v = u32::from_str_radix(&gateway, 16).unwrap();
        std::net::Ipv4Addr::from(v.to_le_bytes()).to_string()
    } else {
        gateway
    };
    assert!(!gateway.is_empty(), "{}: no default route on the bridge", b.name);
    for host in [gateway.as_str(), "host.containers.internal", "127.0.0.1"] {
        let probe = format!(
            "import socket\ntry:\n    socket.create_connection(('{host}', {port}), timeout=5)\n    print('connected')\nexcept OSError as e:\n    print('refused', e)"
        );
        let r = podman("planarian", &["exec", &b.name, "python3", "-c", &probe]);
        assert!(r.stdout.starts_with("refused"), "{}: {host}:{port} from inside: {r:?}", b.name);
    }
    drop(listener);
}
