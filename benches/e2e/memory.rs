//! Live heap bytes per in-flight request, with the layer minus without it,
//! counted by a global allocator.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    sync::{
        atomic::{AtomicIsize, AtomicUsize, Ordering},
        Arc,
    },
};

use axum::body::Bytes;
use http::Request;
use http_body_util::Full;
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_idempotency::{
    fingerprint::TypedFingerprinter, memory::MemoryStore, scope::SingleTenant, IdempotencyLayer,
    RequestBody,
};

use crate::servers::NewOrder;

/// Counts live heap bytes, to measure the layer's memory per in-flight request.
/// (A global allocator is unsafe to implement; it only forwards to `System`.)
struct Counting;
static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Live heap bytes per request held inside a handler, with and without the
/// layer (MemoryStore, no HTTP), minus the buffered request body.
pub(crate) async fn memory_per_in_flight_request() -> (f64, usize) {
    const N: usize = 1000;
    let body = Bytes::from_static(br#"{"checkout_id":"chk-mem","total":2400}"#);
    let measure = |layered: bool| {
        let body = body.clone();
        async move {
            let (reached, release) = (Arc::new(AtomicUsize::new(0)), Arc::new(Notify::new()));
            let all_in = Arc::new(Notify::new());
            let handler = tower::service_fn({
                let (reached, release, all_in) = (reached.clone(), release.clone(), all_in.clone());
                move |_request: Request<RequestBody>| {
                    let (reached, release, all_in) =
                        (reached.clone(), release.clone(), all_in.clone());
                    async move {
                        let notified = release.notified();
                        if reached.fetch_add(1, Ordering::SeqCst) + 1 == N {
                            all_in.notify_one();
                        }
                        notified.await;
                        Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                            Bytes::from_static(b"{}"),
                        )))
                    }
                }
            });
            let store = MemoryStore::new();
            let layer = IdempotencyLayer::new(
                store,
                "POST /orders v1",
                TypedFingerprinter::<NewOrder>::new("orders.v1"),
            )
            .tenant_resolver(SingleTenant::new("mem"));
            let before = LIVE.load(Ordering::SeqCst);
            let tasks: Vec<_> = (0..N)
                .map(|i| {
                    let request = Request::post("/orders")
                        .header("idempotency-key", format!("mem-{i:06}"))
                        .body(Full::new(body.clone()))
                        .expect("request");
                    if layered {
                        let service = tower::Layer::layer(&layer, handler.clone());
                        tokio::spawn(async move { service.oneshot(request).await.map(|_| ()).ok() })
                    } else {
                        let service = handler.clone();
                        let request = request.map(|_| RequestBody::from(body.clone()));
                        tokio::spawn(async move { service.oneshot(request).await.map(|_| ()).ok() })
                    }
                })
                .collect();
            all_in.notified().await;
            let live = LIVE.load(Ordering::SeqCst) - before;
            release.notify_waiters();
            for task in tasks {
                let _ = task.await;
            }
            live as f64 / N as f64
        }
    };
    let bare = measure(false).await;
    let layered = measure(true).await;
    (layered - bare - body.len() as f64, body.len())
}
