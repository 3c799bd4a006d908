//! `baton certs`: a development CA and one certificate per node, for mutual TLS on the worker
//! plane (compose and Kubernetes examples use them). A production cluster brings its own CA.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use baton_shared::tls::{DevCa, write_pem};

/// Flags of `baton certs`.
#[derive(Debug, clap::Args)]
pub struct CertsArgs {
    /// Nodes to certify: `NAME` (the certificate covers NAME) or `NAME=SAN,SAN,...` (it covers
    /// those DNS names and IP addresses), e.g. `coordinator worker-0 worker-1=worker-1,10.0.0.7`.
    #[arg(required = true)]
    pub nodes: Vec<String>,
    /// Folder to write `ca.pem`, `ca.key` and `NAME.pem` / `NAME.key` into; an existing
    /// `ca.pem` + `ca.key` there is reused, so nodes can be added later.
    #[arg(long, default_value = "certs")]
    pub out: PathBuf,
    /// Extra names every node certificate covers, e.g. `--san localhost --san 127.0.0.1`.
    #[arg(long)]
    pub san: Vec<String>,
    /// Days the certificates are valid.
    #[arg(long, default_value_t = 365)]
    pub days: u32,
}

/// One node to certify.
#[derive(Debug, PartialEq)]
struct NodeSpec {
    name: String,
    sans: Vec<String>,
}

fn parse_node(spec: &str, extra: &[String]) -> Result<NodeSpec> {
    let (name, list) = spec.split_once('=').unwrap_or((spec, spec));
    let valid = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    anyhow::ensure!(
        valid(name),
        "node name '{name}' must be letters, digits, '-', '_' or '.' (it names the files)"
    );
    let mut sans: Vec<String> = list
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    anyhow::ensure!(!sans.is_empty(), "node '{name}' lists no names after '='");
    for s in extra {
        if !sans.contains(s) {
            sans.push(s.clone());
        }
    }
    Ok(NodeSpec {
        name: name.to_string(),
        sans,
    })
}

fn load_or_make_ca(dir: &Path, days: u32) -> Result<(DevCa, bool)> {
    let (cert, key) = (dir.join("ca.pem"), dir.join("ca.key"));
    if cert.exists() && key.exists() {
        let read = |p: &Path| std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()));
        let ca =
            DevCa::load(read(&cert)?, read(&key)?).with_context(|| format!("loading the CA in {}", dir.display()))?;
        return Ok((ca, false));
    }
    let ca = DevCa::generate(days)?;
    write_pem(&cert, &ca.cert_pem, false)?;
    write_pem(&key, &ca.key_pem, true)?;
    Ok((ca, true))
}

pub fn run(args: CertsArgs) -> Result<()> {
    anyhow::ensure!(args.days > 0, "--days must be at least 1");
    let nodes = args
        .nodes
        .iter()
        .map(|n| parse_node(n, &args.san))
        .collect::<Result<Vec<_>>>()?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let (ca, fresh) = load_or_make_ca(&args.out, args.days)?;
    println!(
        "{} CA: {} (keep ca.key off the nodes)",
        if fresh { "new" } else { "reused" },
        args.out.join("ca.pem").display()
    );
    for node in &nodes {
        let issued = ca.issue_now(&node.sans, args.days)?;
        let (cert, key) = (
            args.out.join(format!("{}.pem", node.name)),
            args.out.join(format!("{}.key", node.name)),
        );
        write_pem(&cert, &issued.cert, false)?;
        write_pem(&key, &issued.key, true)?;
        println!(
            "{}: {} {} for {}",
            node.name,
            cert.display(),
            key.display(),
            node.sans.join(", ")
        );
    }
    println!(
        "use: --tls-cert NODE.pem --tls-key NODE.key --tls-ca {} on `baton coordinator` and `baton worker` (https:// URLs)",
        args.out.join("ca.pem").display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_specs() {
        let extra = vec!["localhost".to_string()];
        assert_eq!(
            parse_node("worker-0", &extra).unwrap(),
            NodeSpec {
                name: "worker-0".into(),
                sans: vec!["worker-0".into(), "localhost".into()]
            }
        );
        assert_eq!(
            parse_node("w1=w1.svc,10.0.0.7", &[]).unwrap().sans,
            vec!["w1.svc".to_string(), "10.0.0.7".into()]
        );
        assert!(
            parse_node("../etc=x", &[])
                .unwrap_err()
                .to_string()
                .contains("node name")
        );
        assert!(parse_node("w=", &[]).is_err());
    }
}
