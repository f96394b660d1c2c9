use anyhow::Result;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    #[arg(long)]
    pub quick: bool,
    #[arg(long)]
    pub json: bool,
}

pub fn run(_a: &BenchArgs) -> Result<()> {
    anyhow::bail!("WIP")
}
