//! The runc/crun command line as Podman and conmon send it: global flags, then a verb.
//!
//! Only what planarian itself needs is read here (where to log, the verb); the argument vector is
//! kept untouched so that a pass-through verb reaches crun byte for byte, including flags this
//! parser has never heard of.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

/// Global flags of runc/crun that take a separate value (`--root /run/x`); `--flag=value` works
/// for every flag.
const VALUE_FLAGS: &[&str] = &[
    "--root",
    "--log",
    "--log-format",
    "--log-level",
    "--cgroup-manager",
    "--criu",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// One invocation of the runtime.
#[derive(Debug)]
pub struct Invocation {
    /// `argv[1..]`, exactly as received.
    pub args: Vec<OsString>,
    /// Index in `args` of the verb, if there is one.
    pub verb_index: Option<usize>,
    pub log: Option<PathBuf>,
    pub log_format: LogFormat,
    pub root: Option<PathBuf>,
    pub debug: bool,
}

impl Invocation {
    pub fn parse(args: Vec<OsString>) -> Invocation {
        let mut inv = Invocation {
            args,
            verb_index: None,
            log: None,
            log_format: LogFormat::Text,
            root: None,
            debug: false,
        };
        let mut i = 0;
        while i < inv.args.len() {
            let arg = inv.args[i].as_bytes();
            if !arg.starts_with(b"-") || arg == b"-" {
                inv.verb_index = Some(i);
                break;
            }
            if arg == b"--" {
                if i + 1 < inv.args.len() {
                    inv.verb_index = Some(i + 1);
                }
                break;
            }
            let (name, inline) = match arg.iter().position(|&b| b == b'=') {
                Some(eq) => (&arg[..eq], Some(OsStr::from_bytes(&arg[eq + 1..]).to_owned())),
                None => (arg, None),
            };
            let takes_value = VALUE_FLAGS.iter().any(|f| f.as_bytes() == name);
            let value = if takes_value && inline.is_none() {
                i += 1;
                inv.args.get(i).cloned()
            } else {
                inline
            };
            match name {
                b"--log" => inv.log = value.map(PathBuf::from),
                b"--log-format" => {
                    inv.log_format = if value.as_deref() == Some(OsStr::new("json")) {
                        LogFormat::Json
                    } else {
                        LogFormat::Text
                    }
                }
                b"--root" => inv.root = value.map(PathBuf::from),
                b"--debug" => inv.debug = true,
                b"--log-level" => {
                    inv.debug |= matches!(value.as_deref().and_then(OsStr::to_str), Some("debug" | "info"));
                }
                _ => {}
            }
            i += 1;
        }
        inv
    }

    /// The verb as a string (`create`, `checkpoint`, …), if any and if it is valid UTF-8.
    pub fn verb(&self) -> Option<&str> {
        self.verb_index.and_then(|i| self.args[i].to_str())
    }

    /// The global flags before the verb (or all flags when there is no verb).
    pub fn global_args(&self) -> &[OsString] {
        &self.args[..self.verb_index.unwrap_or(self.args.len())]
    }

    /// The arguments after the verb.
    pub fn verb_args(&self) -> &[OsString] {
        match self.verb_index {
            Some(i) => &self.args[i + 1..],
            None => &[],
        }
    }

    /// Whether a global flag (before the verb) was given, e.g. `--version`.
    pub fn has_global_flag(&self, flag: &str) -> bool {
        self.global_args().iter().any(|a| a == flag)
    }
}

/// Parses the arguments of one of planarian's own verbs with clap. On `--help` or a usage error,
/// clap's text is printed and the exit code returned as `Err`.
pub fn parse_verb<T: clap::Parser>(verb: &str, args: &[OsString]) -> Result<T, i32> {
    T::try_parse_from(std::iter::once(OsString::from(verb)).chain(args.iter().cloned())).map_err(|e| {
        let _ = e.print();
        e.exit_code()
    })
}

/// The CRIU-related flags `checkpoint` and `restore` share (runc/crun spelling).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct CriuFlags {
    #[arg(long)]
    pub tcp_established: bool,
    #[arg(long)]
    pub file_locks: bool,
    #[arg(long)]
    pub ext_unix_sk: bool,
    #[arg(long)]
    pub shell_job: bool,
    #[arg(long)]
    pub manage_cgroups_mode: Option<String>,
}

/// Options of `crun exec` that take a separate value.
const EXEC_VALUE_FLAGS: &[&str] = &[
    "--apparmor", "--console-socket", "--cwd", "--cap", "--env", "-e", "--process", "-p",
    "--process-label", "--pid-file", "--preserve-fds", "--user", "-u", "--cgroup",
];

/// The container ID of an `exec` invocation: its first positional argument.
pub fn exec_container_id(args: &[OsString]) -> Option<&str> {
    let mut i = 0;
    while i < args.len() {
        let a = args[i].to_str()?;
        if a == "--" {
            return args.get(i + 1)?.to_str();
        }
        if !a.starts_with('-') {
            return Some(a);
        }
        if !a.contains('=') && EXEC_VALUE_FLAGS.contains(&a) {
            i += 1;
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inv(args: &[&str]) -> Invocation {
        Invocation::parse(args.iter().map(OsString::from).collect())
    }

    #[test]
    fn conmon_create_line_is_read_and_kept() {
        let line = [
            "--systemd-cgroup",
            "--log-format=json",
            "--log",
            "/run/x/oci-log",
            "--root",
            "/run/crun",
            "create",
            "--bundle",
            "/b",
            "--pid-file",
            "/p",
            "ctr",
        ];
        let i = inv(&line);
        assert_eq!(i.verb(), Some("create"));
        assert_eq!(i.log_format, LogFormat::Json);
        assert_eq!(i.log.as_deref(), Some(std::path::Path::new("/run/x/oci-log")));
        assert_eq!(i.root.as_deref(), Some(std::path::Path::new("/run/crun")));
        assert_eq!(i.verb_args().len(), 5);
        // Nothing was dropped or reordered.
        assert_eq!(i.args, line.iter().map(OsString::from).collect::<Vec<_>>());
    }

    #[test]
    fn unknown_flags_are_passed_over() {
        let i = inv(&["--some-new-flag", "--other=1", "kill", "ctr", "15"]);
        assert_eq!(i.verb(), Some("kill"));
        assert_eq!(i.verb_args(), &[OsString::from("ctr"), OsString::from("15")]);
    }

    #[test]
    fn value_flag_value_is_not_the_verb() {
        let i = inv(&["--log-format", "json", "--log-level", "debug", "state", "c"]);
        assert_eq!(i.verb(), Some("state"));
        assert_eq!(i.log_format, LogFormat::Json);
    }

    #[test]
    fn version_without_verb() {
        let i = inv(&["--version"]);
        assert_eq!(i.verb(), None);
        assert!(i.has_global_flag("--version"));
    }

    #[test]
    fn exec_container_id_as_conmon_sends_it() {
        let a: Vec<OsString> = ["--detach", "--process", "/tmp/p.json", "--pid-file", "/x/pid", "--console-socket=/s", "-e", "A=1", "abc123", "sh"]
            .iter()
            .map(OsString::from)
            .collect();
        assert_eq!(exec_container_id(&a), Some("abc123"));
        assert_eq!(exec_container_id(&[OsString::from("-d")]), None);
    }

    #[test]
    fn no_arguments() {
        let i = inv(&[]);
        assert_eq!(i.verb(), None);
        assert!(i.verb_args().is_empty());
    }
}
