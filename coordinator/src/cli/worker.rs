//! `baton worker`: run a pipeline worker in this process (same as the `baton-worker` binary).

use anyhow::Result;
use baton_worker::run::WorkerArgs;

use super::Ctx;

pub fn run(ctx: &Ctx, args: WorkerArgs) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(baton_worker::run::run(args, ctx.settings.clone()))
}
