//! Diesel table definitions, kept by hand in step with `migrations/`
//! (a test runs the migrations and then queries through these).

diesel::table! {
    activities (id) {
        id -> Int8,
        sku_id -> Int8,
        name -> Text,
        price_cents -> Int8,
        start_at -> Timestamptz,
        end_at -> Timestamptz,
        per_user_limit -> Int4,
        pay_timeout_secs -> Int4,
        buckets -> Int4,
        status -> Text,
        warmed_at -> Nullable<Timestamptz>,
        created_at -> Timestamptz,
        updated_at -> Timestamptz,
        shards -> Int4,
        admission -> Text,
        admission_since -> Nullable<Timestamptz>,
    }
}

diesel::table! {
    stock (activity_id) {
        activity_id -> Int8,
        total -> Int4,
        available -> Int4,
        locked -> Int4,
        sold -> Int4,
        updated_at -> Timestamptz,
    }
}

diesel::table! {
    coupons (id) {
        id -> Int8,
        name -> Text,
        total -> Int4,
        claimed -> Int4,
        discount_cents -> Int8,
        min_amount_cents -> Int8,
        per_user_limit -> Int4,
        valid_until -> Timestamptz,
        created_at -> Timestamptz,
    }
}

diesel::table! {
    orders (order_no) {
        order_no -> Int8,
        user_slot -> Int2,
        request_id -> Text,
        activity_id -> Int8,
        user_id -> Int8,
        quantity -> Int4,
        amount_cents -> Int8,
        coupon_id -> Nullable<Int8>,
        status -> Text,
        failure_reason -> Nullable<Text>,
        pay_deadline -> Nullable<Timestamptz>,
        created_at -> Timestamptz,
        updated_at -> Timestamptz,
        paid_at -> Nullable<Timestamptz>,
        closed_at -> Nullable<Timestamptz>,
    }
}

diesel::table! {
    stock_flow (id) {
        id -> Int8,
        activity_id -> Int8,
        biz_type -> Text,
        biz_no -> Int8,
        quantity -> Int4,
        created_at -> Timestamptz,
    }
}

diesel::table! {
    consume_log (event_id, consumer) {
        event_id -> Text,
        consumer -> Text,
        created_at -> Timestamptz,
    }
}

diesel::table! {
    outbox (id) {
        id -> Int8,
        topic -> Text,
        event_key -> Text,
        payload -> Jsonb,
        status -> Text,
        attempts -> Int4,
        next_attempt_at -> Timestamptz,
        last_error -> Nullable<Text>,
        created_at -> Timestamptz,
        sent_at -> Nullable<Timestamptz>,
    }
}

diesel::table! {
    payments (payment_no) {
        payment_no -> Int8,
        order_no -> Int8,
        amount_cents -> Int8,
        status -> Text,
        provider -> Text,
        provider_txn_id -> Nullable<Text>,
        created_at -> Timestamptz,
        updated_at -> Timestamptz,
        paid_at -> Nullable<Timestamptz>,
        checkout -> Nullable<Jsonb>,
        provider_ref -> Nullable<Text>,
        next_check_at -> Timestamptz,
        checks -> Int4,
        closed_at -> Nullable<Timestamptz>,
        pays_order -> Bool,
    }
}

diesel::table! {
    payment_statements (provider, bill_date) {
        provider -> Text,
        bill_date -> Date,
        provider_rows -> Int4,
        our_rows -> Int4,
        differences -> Int4,
        report -> Jsonb,
        created_at -> Timestamptz,
    }
}

diesel::table! {
    refunds (refund_no) {
        refund_no -> Int8,
        payment_no -> Int8,
        amount_cents -> Int8,
        kind -> Text,
        reason -> Text,
        status -> Text,
        accepted -> Bool,
        provider_refund_id -> Nullable<Text>,
        attempts -> Int4,
        next_attempt_at -> Timestamptz,
        last_error -> Nullable<Text>,
        created_at -> Timestamptz,
        updated_at -> Timestamptz,
        refunded_at -> Nullable<Timestamptz>,
    }
}

diesel::table! {
    user_coupons (id) {
        id -> Int8,
        coupon_id -> Int8,
        user_id -> Int8,
        request_id -> Text,
        status -> Text,
        order_no -> Nullable<Int8>,
        claimed_at -> Timestamptz,
        updated_at -> Timestamptz,
    }
}

diesel::table! {
    waiting_rooms (activity_id) {
        activity_id -> Int8,
        prequeue_secs -> Int4,
        admit_per_sec -> Int4,
        max_active -> Nullable<Int4>,
        pass_ttl_secs -> Int4,
        offer_secs -> Int4,
        pow_difficulty -> Int8,
        seed -> Text,
        epoch -> Int4,
        opened_at -> Nullable<Timestamptz>,
        created_at -> Timestamptz,
        updated_at -> Timestamptz,
        method -> Text,
    }
}

diesel::joinable!(stock -> activities (activity_id));
diesel::joinable!(waiting_rooms -> activities (activity_id));
diesel::joinable!(orders -> activities (activity_id));
diesel::joinable!(orders -> coupons (coupon_id));
diesel::joinable!(payments -> orders (order_no));
diesel::joinable!(refunds -> payments (payment_no));
diesel::joinable!(user_coupons -> coupons (coupon_id));

diesel::allow_tables_to_appear_in_same_query!(
    activities,
    stock,
    coupons,
    orders,
    stock_flow,
    consume_log,
    outbox,
    payments,
    payment_statements,
    refunds,
    user_coupons,
    waiting_rooms,
);
