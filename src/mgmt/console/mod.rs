//! The web console: a single page (plain JavaScript, no framework, no network beyond this
//! listener) embedded in the binary and served outside `/api/`. The page reads the `/api/...`
//! endpoints with the user's basic-auth credentials, so the files themselves need no
//! authentication: they hold nothing but code.
//!
//! Sans-IO like the rest of [`crate::mgmt`]: [`asset`] decides which file answers a
//! request; the driver ([`crate::runtime::mgmt`]) only writes it out.
//!
//! - `index.html`: the frame (header, navigation, login form);
//! - `console.css`: the look;
//! - `api.js`: calls to `/api/...` with the credentials kept in `sessionStorage`;
//! - `ring.js`: the SVG drawing of a queue's GM ring;
//! - `views.js`: the views (overview, queues, one queue, connections, policies);
//! - `app.js`: login, hash routing and the live refresh loop.

use super::{Method, Request};

/// One embedded file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Asset {
    /// Its `Content-Type`.
    pub content_type: &'static str,
    /// Its bytes.
    pub body: &'static [u8],
}

/// The files by the path they are served at.
const ASSETS: &[(&str, Asset)] = &[
    ("/index.html", file(HTML, include_bytes!("index.html"))),
    ("/console.css", file(CSS, include_bytes!("console.css"))),
    ("/api.js", file(JS, include_bytes!("api.js"))),
    ("/ring.js", file(JS, include_bytes!("ring.js"))),
    ("/views.js", file(JS, include_bytes!("views.js"))),
    ("/app.js", file(JS, include_bytes!("app.js"))),
];

const HTML: &str = "text/html; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";
const JS: &str = "text/javascript; charset=utf-8";

const fn file(content_type: &'static str, body: &'static [u8]) -> Asset {
    Asset { content_type, body }
}

/// The file a GET (or HEAD) of `req`'s path names: `/` is `index.html`; `/api/...` and
/// unknown paths are none (the API answers them).
pub fn asset(req: &Request) -> Option<Asset> {
    if req.method != Method::Get || req.path.starts_with("/api/") {
        return None;
    }
    let path = if req.path == "/" {
        "/index.html"
    } else {
        req.path.as_str()
    };
    ASSETS.iter().find(|(p, _)| *p == path).map(|(_, a)| *a)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(path: &str) -> Option<Asset> {
        asset(&Request::new(Method::Get, path, None))
    }

    #[test]
    fn the_root_is_the_page_and_files_carry_their_type() {
        let root = get("/").expect("index");
        assert_eq!(root.content_type, HTML);
        assert!(std::str::from_utf8(root.body).unwrap().contains("app.js"));
        assert_eq!(get("/index.html"), Some(root));
        assert_eq!(get("/console.css").map(|a| a.content_type), Some(CSS));
        for js in ["/api.js", "/ring.js", "/views.js", "/app.js"] {
            assert_eq!(get(js).map(|a| a.content_type), Some(JS), "{js}");
        }
    }

    #[test]
    fn the_api_unknown_paths_and_other_methods_are_not_files() {
        assert_eq!(get("/api/overview"), None);
        assert_eq!(get("/api/"), None);
        assert_eq!(get("/nothing.js"), None);
        assert_eq!(asset(&Request::new(Method::Post, "/", None)), None);
    }

    #[test]
    fn every_file_the_page_loads_is_served() {
        let html = std::str::from_utf8(get("/").unwrap().body).unwrap();
        for (path, _) in ASSETS.iter().filter(|(p, _)| *p != "/index.html") {
            assert!(html.contains(&path[1..]), "index.html does not load {path}");
        }
    }
}
