//! A real browser for the tests that need one (the GPU map): Debian's Chromium headless shell
//! (`chromium-headless-shell`, or `NANO_GPU_CHROMIUM`), driven over the Chrome DevTools Protocol on
//! its loopback WebSocket. It resolves no name but `localhost` and `127.0.0.1`, and runs no
//! background service, so it sends nothing off the machine.

use base64::Engine as _;
use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tokio_tungstenite::tungstenite::Message;

type Socket = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// One headless browser with one page; killed (and its profile removed) when dropped.
pub struct Browser {
    child: Child,
    profile: PathBuf,
    socket: Socket,
    /// The page's CDP session.
    session: String,
    next_id: u64,
}

/// The browser binary: `NANO_GPU_CHROMIUM`, else Debian's headless shell.
fn binary() -> PathBuf {
    std::env::var_os("NANO_GPU_CHROMIUM")
        .map_or_else(|| PathBuf::from("/usr/bin/chromium-headless-shell"), PathBuf::from)
}

impl Browser {
    /// Starts the browser on `url` in a `width`×`height` window.
    pub async fn open(url: &str, width: u32, height: u32) -> Browser {
        let bin = binary();
        assert!(
            bin.exists(),
            "{} is missing: apt-get install chromium-headless-shell (or set NANO_GPU_CHROMIUM)",
            bin.display()
        );
        let profile =
            std::env::temp_dir().join(format!("nano-gpu-browser-{}-{}", std::process::id(), rand_suffix()));
        let mut child = Command::new(&bin)
            .args([
                "--no-sandbox",
                "--remote-debugging-port=0",
                "--disable-background-networking",
                "--disable-component-update",
                "--no-first-run",
                "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE localhost , EXCLUDE 127.0.0.1",
                &format!("--window-size={width},{height}"),
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("about:blank")
            // Its own process group: the browser's helpers (zygotes, GPU, network) go with it.
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
        // It prints where its DevTools endpoint listens; the rest of its stderr is drained.
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(at) = line.strip_prefix("DevTools listening on ") {
                    let _ = tx.send(at.to_owned());
                }
            }
        });
        let endpoint =
            rx.recv_timeout(Duration::from_secs(30)).expect("the browser's DevTools endpoint within 30 s");
        let (socket, _) =
            tokio_tungstenite::connect_async(endpoint.as_str()).await.expect("connecting to DevTools");
        let mut browser = Browser { child, profile, socket, session: String::new(), next_id: 0 };
        let targets = browser.call("Target.getTargets", json!({})).await;
        let page = targets["targetInfos"]
            .as_array()
            .and_then(|t| t.iter().find(|t| t["type"] == "page"))
            .and_then(|t| t["targetId"].as_str())
            .expect("a page target")
            .to_owned();
        let attached =
            browser.call("Target.attachToTarget", json!({"targetId": page, "flatten": true})).await;
        browser.session = attached["sessionId"].as_str().expect("a session").to_owned();
        let size = json!({"width": width, "height": height, "deviceScaleFactor": 1, "mobile": false});
        browser.call("Emulation.setDeviceMetricsOverride", size).await;
        browser.call("Page.navigate", json!({"url": url})).await;
        browser
    }

    /// One CDP command (on the page's session once attached); its result. Events are skipped.
    async fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let mut message = json!({"id": id, "method": method, "params": params});
        if !self.session.is_empty() {
            message["sessionId"] = self.session.clone().into();
        }
        self.socket.send(Message::text(message.to_string())).await.expect("sending to DevTools");
        let answer = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(m) = self.socket.next().await {
                let Ok(Message::Text(text)) = m else { continue };
                let v: Value = serde_json::from_str(&text).unwrap_or_default();
                if v["id"] == id {
                    return v;
                }
            }
            panic!("DevTools closed during {method}");
        })
        .await
        .unwrap_or_else(|_| panic!("no answer to {method} within 30 s"));
        assert!(answer.get("error").is_none(), "{method}: {}", answer["error"]);
        answer["result"].clone()
    }

    /// The value of the JavaScript `expression` in the page (awaited if a promise).
    pub async fn eval(&mut self, expression: &str) -> Value {
        let params = json!({"expression": expression, "returnByValue": true, "awaitPromise": true});
        let result = self.call("Runtime.evaluate", params).await;
        assert!(result.get("exceptionDetails").is_none(), "{expression}: {}", result["exceptionDetails"]);
        result["result"]["value"].clone()
    }

    /// Polls `expression` every 250 ms until it is `true` (an exception, as while the page still
    /// loads, counts as not yet); fails the test after `limit`.
    pub async fn wait_for(&mut self, what: &str, expression: &str, limit: Duration) {
        let start = std::time::Instant::now();
        let guarded = format!("(() => {{ try {{ return {expression}; }} catch (e) {{ return false; }} }})()");
        while self.eval(&guarded).await != Value::Bool(true) {
            if start.elapsed() >= limit {
                let page = self.eval("location.href + ' ' + document.readyState + '\\n' + (document.body ? document.body.innerText.slice(0, 2000) : '(no body)')").await;
                panic!(
                    "{what}: not within {limit:?}; the page shows:\n{}",
                    page.as_str().unwrap_or_default()
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// A PNG of the whole page, written to `path`.
    pub async fn screenshot(&mut self, path: &Path) {
        let shot = self
            .call("Page.captureScreenshot", json!({"format": "png", "captureBeyondViewport": true}))
            .await;
        let png = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().unwrap_or_default())
            .unwrap();
        std::fs::write(path, png).unwrap();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // The whole group: killing the first process alone leaves its helpers running, and writing
        // into the profile while it is removed.
        let _ = Command::new("kill").args(["-KILL", "--", &format!("-{}", self.child.id())]).status();
        let _ = self.child.wait();
        for _ in 0..10 {
            if std::fs::remove_dir_all(&self.profile).is_ok() || !self.profile.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A few random hex digits for a unique profile directory (several browsers may run at once).
fn rand_suffix() -> String {
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    format!("{nanos:08x}")
}
