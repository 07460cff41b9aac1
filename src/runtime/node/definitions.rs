//! Definitions at start: a single node's durable definitions file (replayed, then kept
//! current), and the `[definitions] load_file` import.

use std::sync::Arc;

use super::NodeError;
use crate::broker::Broker;
use crate::config::Config;
use crate::meta::definitions::Definitions;
use crate::runtime::clock::Clock;
use crate::runtime::conn_task::MetaCommit;
use crate::runtime::file_disk::FileDisk;
use crate::store::Disk;

const DEFINITIONS_FILE: &str = "definitions";

/// Replays the durable definitions saved in `data_dir`, then installs the sink that keeps
/// that file current (write to a temporary file, fsync, rename, fsync the folder).
pub(super) fn recover_definitions(broker: Broker, data_dir: &std::path::Path) -> Broker {
    let disk = FileDisk::new();
    let path = data_dir.join(DEFINITIONS_FILE);
    match disk.len(&path) {
        Ok(Some(_)) => match disk
            .read(&path)
            .map_err(|e| e.to_string())
            .and_then(|b| Definitions::decode(&b).map_err(|e| e.to_string()))
        {
            Ok(defs) => {
                let mut applied = 0;
                for c in defs.commands() {
                    match broker.apply(&c, crate::time::Instant::from_millis(0)) {
                        Ok(_) => applied += 1,
                        Err(e) => tracing::warn!(error = %e, "cannot restore a definition"),
                    }
                }
                tracing::info!(definitions = applied, "durable definitions restored");
            }
            // A damaged file must not stop the node: report and start without them.
            Err(e) => {
                tracing::error!(path = %path.display(), error = %e, "definitions file unreadable; starting without durable definitions")
            }
        },
        Ok(None) => {}
        Err(e) => {
            tracing::error!(path = %path.display(), error = %e, "cannot stat definitions file")
        }
    }
    let dir = data_dir.to_path_buf();
    broker.with_definitions_sink(Box::new(move |defs: &Definitions| {
        let tmp = dir.join("definitions.tmp");
        let target = dir.join(DEFINITIONS_FILE);
        disk.write_file(&tmp, &defs.encode())
            .and_then(|()| disk.sync(&tmp))
            .and_then(|()| disk.rename(&tmp, &target))
            .and_then(|()| disk.sync_dir(&dir))
            .map_err(|e| e.to_string())
    }))
}

/// Imports `[definitions] load_file`, when set, through the admin endpoint's import (so
/// committed like any change); a file that cannot be read or imported stops the start.
pub(super) async fn load_file(
    config: &Config,
    broker: &Arc<Broker>,
    meta: &Arc<dyn MetaCommit>,
    clock: Clock,
) -> Result<(), NodeError> {
    if config.definitions.load_file.is_empty() {
        return Ok(());
    }
    let path = config.definitions.load_file.clone();
    let fail = |reason: String| NodeError::Definitions {
        path: path.clone(),
        reason,
    };
    let json = std::fs::read(&path).map_err(|e| fail(e.to_string()))?;
    let importer = crate::runtime::admin::AdminContext {
        broker: broker.clone(),
        node: crate::admin::NodeInfo {
            name: config.node.name.clone(),
        },
        clock,
        meta: meta.clone(),
        cluster: None,
    };
    let r = crate::runtime::admin::import_definitions(&importer, &json).await;
    if !r.ok {
        return Err(fail(r.message));
    }
    tracing::info!(%path, "{}", r.message);
    Ok(())
}
