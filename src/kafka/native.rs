//! A record handed to librdkafka through its C API, with a topic handle
//! the producer keeps.
//!
//! rdkafka's `BaseProducer::send` names the topic of every record: it
//! copies the name into a new C string, and librdkafka then looks the
//! topic up under its handle's write lock, comparing the name with every
//! topic the producer knows (`rd_kafka_topic_new0`, a list). On 50 topics
//! that is a lock the broker threads also take, and about 25 string
//! comparisons per record. [`Topics`] keeps one librdkafka topic handle
//! per topic name (`rd_kafka_topic_new`, once), and [`produce`] passes the
//! handle (`RD_KAFKA_VTYPE_RKT`): librdkafka only counts a reference.
//!
//! What librdkafka does with the record is otherwise the same call that
//! rdkafka makes (`rd_kafka_producev`): the same flags (it copies key,
//! value and headers), the same partitioner and topic configuration (a
//! handle made with no configuration of its own takes the producer's
//! default, as a topic named in `producev` does), the same delivery
//! opaque (the ticket, a number), and the same errors.
//!
//! **Lifetimes.** librdkafka wants every topic handle destroyed before its
//! producer, and used with no other: [`Topics`] holds its producer, and
//! destroys its handles when it is dropped, before that reference goes.
//! The number of handles is bounded ([`MAX_TOPICS`]): a topic template
//! that names a new topic per event sends the topics beyond the bound by
//! name, as before, instead of keeping a handle for each.
#![allow(unsafe_code)]

use std::ffi::{c_void, CString};
use std::ptr::NonNull;
use std::sync::{Arc, RwLock};

use rdkafka::bindings as rdsys;
use rdkafka::error::{IsError, KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseProducer, Producer as _, ProducerContext};

use crate::kafka::FastMap;

/// librdkafka's "unassigned partition": its partitioner picks one.
const PARTITION_UA: i32 = -1;

/// Topic handles kept at most per producer (see the module doc).
pub const MAX_TOPICS: usize = 1024;

/// One record as librdkafka takes it: borrowed, since it copies
/// everything (`RD_KAFKA_MSG_F_COPY`, and header values on add).
#[derive(Debug)]
pub struct Outgoing<'a, H> {
    pub topic: &'a str,
    /// `None`: the partitioner picks, from the key.
    pub partition: Option<i32>,
    pub key: &'a [u8],
    /// `None`: a null value.
    pub value: Option<&'a [u8]>,
    pub headers: &'a [(H, Vec<u8>)],
    pub timestamp_ms: i64,
}

/// A librdkafka topic handle, destroyed when dropped.
struct TopicHandle(NonNull<rdsys::rd_kafka_topic_t>);

// SAFETY: librdkafka's topic handles may be used and destroyed from any
// thread (rdkafka.h: "all ... APIs are thread-safe").
unsafe impl Send for TopicHandle {}
unsafe impl Sync for TopicHandle {}

impl Drop for TopicHandle {
    fn drop(&mut self) {
        // SAFETY: the handle came from rd_kafka_topic_new and is destroyed
        // once, here; its producer still exists (`Topics` holds it).
        unsafe { rdsys::rd_kafka_topic_destroy(self.0.as_ptr()) }
    }
}

/// The topic handles of one producer, by topic name. It holds the
/// producer, so a handle can neither outlive its producer nor be used on
/// another; handles are destroyed only when it is dropped (before its
/// reference to the producer goes), never while it is shared.
pub struct Topics<C: ProducerContext + 'static> {
    handles: RwLock<FastMap<Box<str>, TopicHandle>>,
    producer: Arc<BaseProducer<C>>,
}

impl<C: ProducerContext + 'static> std::fmt::Debug for Topics<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Topics").field("handles", &self.len()).finish()
    }
}

impl<C: ProducerContext + 'static> Drop for Topics<C> {
    fn drop(&mut self) {
        // Every handle goes before the producer can (the field after).
        self.handles
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clear();
    }
}

impl<C: ProducerContext + 'static> Topics<C> {
    /// No handle yet, for `producer`.
    pub fn new(producer: Arc<BaseProducer<C>>) -> Topics<C> {
        Topics {
            handles: RwLock::default(),
            producer,
        }
    }

    /// Handles kept now.
    pub fn len(&self) -> usize {
        self.handles.read().map(|h| h.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The kept handle of `topic`, made if there is room. A handle stays
    /// valid while `self` lives: none is removed before the drop.
    fn handle(&self, topic: &str, name: &CString) -> Option<NonNull<rdsys::rd_kafka_topic_t>> {
        let mut write = self
            .handles
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(h) = write.get(topic) {
            return Some(h.0);
        }
        if write.len() >= MAX_TOPICS {
            return None;
        }
        // SAFETY: the producer is alive (held), name a valid C string; a
        // null configuration takes the producer's default topic
        // configuration.
        let made = unsafe { rdsys::rd_kafka_topic_new(self.rk(), name.as_ptr(), std::ptr::null_mut()) };
        let h = NonNull::new(made)?;
        write.insert(topic.into(), TopicHandle(h));
        Some(h)
    }

    fn rk(&self) -> *mut rdsys::rd_kafka_t {
        self.producer.client().native_ptr()
    }

    /// Enqueues `record` on the producer with delivery opaque `ticket`:
    /// through a kept handle of its topic, or by name when no handle can
    /// be had (past [`MAX_TOPICS`], or a name librdkafka refuses as a
    /// handle: it then refuses the send too, with its reason). Only a new
    /// topic takes the write lock, and no lock is held during the send.
    pub fn produce<H: AsRef<str>>(&self, record: &Outgoing<'_, H>, ticket: usize) -> Result<(), KafkaError> {
        let kept = {
            let read = self
                .handles
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            match read.get(record.topic) {
                Some(h) => Ok(h.0),
                None => Err(read.len() >= MAX_TOPICS),
            }
        };
        match kept {
            Ok(h) => produce(self.rk(), Target::Handle(h), record, ticket),
            Err(full) => {
                let name = CString::new(record.topic)?;
                match (!full).then(|| self.handle(record.topic, &name)).flatten() {
                    Some(h) => produce(self.rk(), Target::Handle(h), record, ticket),
                    None => produce(self.rk(), Target::Name(&name), record, ticket),
                }
            }
        }
    }
}

/// Where a record goes: a kept handle, or a topic named in the call.
enum Target<'a> {
    Handle(NonNull<rdsys::rd_kafka_topic_t>),
    Name(&'a CString),
}

/// One `rd_kafka_producev` call, as rdkafka's `BaseProducer::send` makes
/// it, with the topic given as `target`.
fn produce<H: AsRef<str>>(
    rk: *mut rdsys::rd_kafka_t,
    target: Target<'_>,
    record: &Outgoing<'_, H>,
    ticket: usize,
) -> Result<(), KafkaError> {
    use rdsys::rd_kafka_vtype_t::*;
    let headers = headers(record.headers)?;
    let (value_ptr, value_len) = match record.value {
        Some(v) => (v.as_ptr() as *mut c_void, v.len()),
        None => (std::ptr::null_mut(), 0),
    };
    let (key_ptr, key_len) = (record.key.as_ptr() as *mut c_void, record.key.len());
    let (vtype, topic): (rdsys::rd_kafka_vtype_t, *mut c_void) = match target {
        Target::Handle(h) => (RD_KAFKA_VTYPE_RKT, h.as_ptr().cast()),
        Target::Name(n) => (RD_KAFKA_VTYPE_TOPIC, n.as_ptr() as *mut c_void),
    };
    // SAFETY: every pointer is valid for the call: librdkafka copies the
    // key, value and topic name (MSG_F_COPY) and takes the header list
    // only when it returns no error; the opaque is a number, never
    // dereferenced (rdkafka reads it back as the ticket).
    let err = unsafe {
        rdsys::rd_kafka_producev(
            rk,
            vtype,
            topic,
            RD_KAFKA_VTYPE_PARTITION,
            record.partition.unwrap_or(PARTITION_UA),
            RD_KAFKA_VTYPE_MSGFLAGS,
            rdsys::RD_KAFKA_MSG_F_COPY,
            RD_KAFKA_VTYPE_VALUE,
            value_ptr,
            value_len,
            RD_KAFKA_VTYPE_KEY,
            key_ptr,
            key_len,
            RD_KAFKA_VTYPE_OPAQUE,
            ticket as *mut c_void,
            RD_KAFKA_VTYPE_TIMESTAMP,
            record.timestamp_ms,
            RD_KAFKA_VTYPE_HEADERS,
            headers,
            RD_KAFKA_VTYPE_END,
        )
    };
    if !err.is_error() {
        return Ok(());
    }
    if !headers.is_null() {
        // SAFETY: librdkafka returned an error, so the list is still ours.
        unsafe { rdsys::rd_kafka_headers_destroy(headers) }
    }
    Err(KafkaError::MessageProduction(RDKafkaErrorCode::from(err)))
}

extern "C" {
    /// `rd_kafka_headers_new` with room for `count` headers of `data`
    /// bytes of names and values in the list's own allocation: the headers
    /// added then cost no allocation each (librdkafka as patched here,
    /// vendor/rdkafka-sys/PATCHES.md).
    fn rd_kafka_headers_new_sized(count: usize, data: usize) -> *mut rdsys::rd_kafka_headers_t;
}

/// A new librdkafka header list holding `headers` (null for none), in
/// two allocations (the list with its headers, and its array of
/// pointers) where upstream makes one more per header.
fn headers<H: AsRef<str>>(headers: &[(H, Vec<u8>)]) -> Result<*mut rdsys::rd_kafka_headers_t, KafkaError> {
    if headers.is_empty() {
        return Ok(std::ptr::null_mut());
    }
    let data: usize = headers.iter().map(|(n, v)| n.as_ref().len() + v.len()).sum();
    // SAFETY: a new list, owned here until producev takes it.
    let list = unsafe { rd_kafka_headers_new_sized(headers.len(), data) };
    for (name, value) in headers {
        // SAFETY: the list is valid, ours until producev takes it.
        let err = unsafe { add_header(list, name.as_ref(), Some(value)) };
        if err.is_error() {
            // SAFETY: the list is ours (not given to librdkafka yet).
            unsafe { rdsys::rd_kafka_headers_destroy(list) }
            return Err(KafkaError::MessageProduction(RDKafkaErrorCode::from(err)));
        }
    }
    Ok(list)
}

/// Adds a header to `list` (a null value for `None`); librdkafka copies
/// name and value.
///
/// # Safety
/// `list` is a valid header list that no other thread uses.
unsafe fn add_header(
    list: *mut rdsys::rd_kafka_headers_t,
    name: &str,
    value: Option<&[u8]>,
) -> rdsys::rd_kafka_resp_err_t {
    let (ptr, len) = value.map_or((std::ptr::null(), 0), |v| (v.as_ptr(), v.len()));
    // SAFETY: name and value are valid for their lengths (a null value
    // with length 0); the caller vouches for the list.
    unsafe {
        rdsys::rd_kafka_header_add(
            list,
            name.as_ptr().cast(),
            name.len() as isize,
            ptr.cast(),
            len as isize,
        )
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use rdkafka::config::ClientConfig;
    use rdkafka::error::{KafkaError, RDKafkaErrorCode};
    use rdkafka::producer::{BaseProducer, DefaultProducerContext, Producer as _};

    use rdkafka::bindings as rdsys;
    use rdkafka::error::IsError;

    use super::{headers as headers_list, Outgoing, Topics, MAX_TOPICS};

    /// Topic handles of a producer whose broker is never reached: records
    /// stay queued.
    fn unreachable() -> Topics<DefaultProducerContext> {
        let producer: BaseProducer = ClientConfig::new()
            .set("bootstrap.servers", "127.0.0.1:9")
            .set("message.timeout.ms", "600000")
            .set("log_level", "0")
            .create()
            .unwrap();
        Topics::new(Arc::new(producer))
    }

    fn to(topic: &str) -> Outgoing<'_, &'static str> {
        const HEADERS: &[(&str, Vec<u8>)] = &[("id", Vec::new()), ("type", Vec::new())];
        Outgoing {
            topic,
            partition: None,
            key: b"k",
            value: Some(b"{}"),
            headers: HEADERS,
            timestamp_ms: 0,
        }
    }

    /// Header `idx` of `list` as librdkafka keeps it: where its name and
    /// value are, and the value's size; `None` past the last.
    fn header_at(
        list: *const rdsys::rd_kafka_headers_t,
        idx: usize,
    ) -> Option<(*const std::ffi::c_char, *const std::ffi::c_void, usize)> {
        let (mut name, mut value, mut size) = (std::ptr::null(), std::ptr::null(), 0usize);
        // SAFETY: a valid list; librdkafka fills the out-pointers.
        let err = unsafe { rdsys::rd_kafka_header_get_all(list, idx, &mut name, &mut value, &mut size) };
        (!err.is_error()).then_some((name, value, size))
    }

    /// Every header of `list`, in order, as librdkafka reads them back.
    fn read_back(list: *const rdsys::rd_kafka_headers_t) -> Vec<(String, Option<Vec<u8>>)> {
        let mut out = Vec::new();
        for idx in 0.. {
            let Some((name, value, size)) = header_at(list, idx) else {
                break;
            };
            // SAFETY: librdkafka's NUL-terminated name, and value of `size` bytes (or null).
            let name = unsafe { std::ffi::CStr::from_ptr(name) }
                .to_str()
                .unwrap()
                .to_owned();
            let value = (!value.is_null())
                .then(|| unsafe { std::slice::from_raw_parts(value.cast::<u8>(), size) }.to_vec());
            out.push((name, value));
        }
        out
    }

    #[test]
    fn headers_in_the_lists_room_read_back_as_added_and_free_with_it() {
        // Sizes that end on every alignment, empty names and values, and
        // one far larger than the rest (all counted in the room).
        let headers: Vec<(String, Vec<u8>)> = (0..12)
            .map(|i| ("h".repeat(i), vec![b'a' + i as u8; (i * 7) % 17]))
            .chain([(String::new(), Vec::new()), ("big".into(), vec![7; 5000])])
            .collect();
        let list = headers_list(&headers).unwrap();
        let expect = |extra: &[(String, Option<Vec<u8>>)]| {
            let mut e: Vec<_> = headers
                .iter()
                .map(|(n, v)| (n.clone(), Some(v.clone())))
                .collect();
            e.extend_from_slice(extra);
            e
        };
        assert_eq!(read_back(list), expect(&[]));
        // Headers added past those counted (in what is left of the room,
        // or allocated on their own); a null value stays null.
        let more = [
            ("late".to_owned(), Some(vec![1u8; 300])),
            ("null".to_owned(), None),
        ];
        for (name, value) in &more {
            // SAFETY: a valid list.
            let err = unsafe { super::add_header(list, name, value.as_deref()) };
            assert!(!err.is_error());
        }
        assert_eq!(read_back(list), expect(&more));
        // A copy, and a removal from the room, read back and free alike.
        // SAFETY: valid lists, each destroyed once below.
        let copy = unsafe { rdsys::rd_kafka_headers_copy(list) };
        let err = unsafe { rdsys::rd_kafka_header_remove(list, c"hhh".as_ptr()) };
        assert!(!err.is_error());
        let mut removed = expect(&more);
        removed.retain(|(n, _)| n != "hhh");
        assert_eq!(read_back(list), removed);
        assert_eq!(read_back(copy), expect(&more));
        unsafe {
            rdsys::rd_kafka_headers_destroy(list);
            rdsys::rd_kafka_headers_destroy(copy);
        }
        // One header, and none.
        let one = [("n".to_owned(), vec![9u8; 8])];
        let list = headers_list(&one).unwrap();
        assert_eq!(read_back(list), vec![("n".to_owned(), Some(vec![9u8; 8]))]);
        unsafe { rdsys::rd_kafka_headers_destroy(list) };
        assert!(headers_list::<String>(&[]).unwrap().is_null());
    }

    /// Where librdkafka keeps header `idx`'s name.
    fn name_at(list: *const rdsys::rd_kafka_headers_t, idx: usize) -> usize {
        header_at(list, idx).expect("the header is in the list").0 as usize
    }

    #[test]
    fn a_header_that_fits_the_room_is_placed_in_it_and_one_past_it_is_not() {
        // On 64-bit, the list takes 64 bytes and a header 36 before its
        // name, value and their two NULs, rounded up to 8: a room for one
        // header of no data is 40 + 8 bytes of slack, so one of 10 bytes
        // of name and value fills it exactly.
        // SAFETY: a new list, destroyed below.
        let list = unsafe { super::rd_kafka_headers_new_sized(1, 0) };
        let add = |name: &str, value: &[u8]| {
            // SAFETY: a valid list.
            let err = unsafe { super::add_header(list, name, Some(value)) };
            assert!(!err.is_error());
        };
        add("ab", b"12345678");
        add("c", b"9");
        let (start, end) = (list as usize, list as usize + 64 + 48);
        let first = name_at(list, 0);
        assert!(
            (start + 64..end).contains(&first),
            "the first header is in the list's room"
        );
        assert_eq!((first - start - 64) % 8, 36 % 8, "and aligned as its struct is");
        let second = name_at(list, 1);
        assert!(
            !(start..end).contains(&second),
            "the second is allocated on its own"
        );
        assert_eq!(
            read_back(list),
            vec![
                ("ab".to_owned(), Some(b"12345678".to_vec())),
                ("c".to_owned(), Some(b"9".to_vec()))
            ]
        );
        // SAFETY: the list is ours; destroyed once.
        unsafe { rdsys::rd_kafka_headers_destroy(list) };
        // What `headers` asks for holds every header it adds.
        let these: Vec<(String, Vec<u8>)> = (0..7).map(|i| (format!("n{i}"), vec![b'x'; i * 13])).collect();
        let list = headers_list(&these).unwrap();
        // The list, then 40 bytes a header, the data rounded up to 8
        // (2 × 7 + 13 × 21 = 287 bytes), and 8 bytes of slack a header.
        let (start, end) = (list as usize, list as usize + 64 + 7 * 40 + 288 + 7 * 8);
        for i in 0..these.len() {
            assert!(
                (start + 64..end).contains(&name_at(list, i)),
                "header {i} is in the list's room"
            );
        }
        // SAFETY: as above.
        unsafe { rdsys::rd_kafka_headers_destroy(list) };
    }

    #[test]
    fn a_topic_handle_is_made_once_and_kept_up_to_the_bound() {
        let topics = unreachable();
        for topic in ["a.events", "b.events", "a.events", "b.events"] {
            topics.produce(&to(topic), 2).unwrap();
        }
        assert_eq!(topics.len(), 2);
        // Past the bound, topics are sent by name: every send is taken.
        let names: Vec<String> = (0..MAX_TOPICS + 5).map(|i| format!("t{i}.events")).collect();
        for name in &names {
            topics.produce(&to(name), 2).unwrap();
        }
        assert_eq!(topics.len(), MAX_TOPICS);
        topics.produce(&to(&names[MAX_TOPICS + 2]), 2).unwrap();
        assert_eq!(topics.len(), MAX_TOPICS);
        // (librdkafka counts its own pending events too.)
        assert!(topics.producer.in_flight_count() >= (4 + MAX_TOPICS + 5 + 1) as i32);
    }

    #[test]
    fn a_topic_librdkafka_refuses_is_refused_with_its_reason_and_keeps_no_handle() {
        let topics = unreachable();
        match topics.produce(&to("bad\0topic"), 2) {
            Err(KafkaError::Nul(_)) => {}
            other => panic!("a NUL in the topic: {other:?}"),
        }
        let long = "x".repeat(600);
        match topics.produce(&to(&long), 2) {
            Err(KafkaError::MessageProduction(code)) => assert_ne!(code, RDKafkaErrorCode::QueueFull),
            other => panic!("a 600-byte topic: {other:?}"),
        }
        assert_eq!(topics.len(), 0);
        // A good topic after them still goes.
        topics.produce(&to("good.events"), 2).unwrap();
        assert_eq!(topics.len(), 1);
        assert!(topics.producer.in_flight_count() >= 1);
    }
}
