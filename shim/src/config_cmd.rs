//! `planarian config [CONTAINER]`: the effective configuration, optionally for one container
//! (its `io.planarian.*` annotations applied), with the files it was read from.

use crate::cli::{ConfigArgs, Invocation};
use crate::Failure;
use engine::config;
use std::ffi::OsString;
use std::path::PathBuf;

pub fn main(inv: &Invocation, args: &[OsString]) -> Result<i32, Failure> {
    let a: ConfigArgs = match crate::cli::parse_verb("config", args) {
        Ok(a) => a,
        Err(code) => return Ok(code),
    };
    let container = a.container.as_deref();
    let engine = inv.engine()?;
    let cfg = match container {
        None => engine.config().clone(),
        Some(id) => {
            let spec = container_spec(&engine, id)?;
            spec.configure(engine.config()).map_err(|e| format!("container {id}: {e}"))?
        }
    };
    let files: Vec<PathBuf> = config::config_files().into_iter().filter(|p| p.exists()).collect();
    println!(
        "# read from: {}",
        if files.is_empty() {
            "(built-in defaults)".into()
        } else {
            files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        }
    );
    if let Some(id) = container {
        println!("# with the io.planarian.* annotations of container {id}");
    }
    print!("{}", toml::to_string(&cfg)?);
    Ok(0)
}

/// A container's OCI config, read from the bundle crun recorded for it.
fn container_spec(engine: &engine::Engine, id: &str) -> Result<engine::runtime::Spec, Failure> {
    let crun = engine::runtime::crun::Crun { bin: engine.crun()?, globals: engine.globals() };
    let state = crun.state(id)?;
    Ok(engine::runtime::Bundle::load(&state.bundle)?.spec)
}
