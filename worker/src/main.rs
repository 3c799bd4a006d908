//! `baton-worker`: the slim worker binary for container images (same as `baton worker`).

use clap::Parser;

#[derive(Parser)]
#[command(name = "baton-worker", version, about = "Baton pipeline worker")]
struct Cli {
    #[command(flatten)]
    args: baton_worker::run::WorkerArgs,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let settings = baton_shared::settings::Settings::load(None, serde_json::json!({ "worker": &cli.args }))?;
    let filter = tracing_subscriber::EnvFilter::try_new(&settings.log_level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(baton_worker::run::run(cli.args, settings))
}
