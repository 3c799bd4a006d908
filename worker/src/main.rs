//! `baton-worker`: the slim worker binary for container images (same as `baton worker`).

use clap::Parser;

#[derive(Parser)]
#[command(name = "baton-worker", version, about = "Baton pipeline worker")]
struct Cli {
    #[command(flatten)]
    args: baton_worker::run::WorkerArgs,
    /// Export traces over OTLP/gRPC to this collector, e.g. http://localhost:4317
    /// (or BATON_OTLP_ENDPOINT / `otlp_endpoint` in baton.toml).
    #[arg(long)]
    otlp_endpoint: Option<String>,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let mut flags = serde_json::json!({ "worker": &cli.args });
    if let Some(endpoint) = &cli.otlp_endpoint {
        flags["otlp_endpoint"] = endpoint.clone().into();
    }
    let settings = baton_shared::settings::Settings::load(None, flags)?;
    let _logging = baton_shared::logging::init(&settings.logging("baton-worker"))?;
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(baton_worker::run::run(cli.args, settings))
}
